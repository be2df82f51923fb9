"""One client session: who it is, how we reach it, and what it holds."""

from __future__ import annotations

import collections
import os
import socket
from dataclasses import dataclass, field

from ..backend.base import SessionContext
from ..fdpass import PeerCred


@dataclass(eq=False)
class Session:
    sid: int
    token: bytes
    cred: PeerCred
    conn: socket.socket
    pidfd: int
    backend: SessionContext
    held: collections.Counter = field(default_factory=collections.Counter)   # alloc id -> holds
    said_bye: bool = False
    orphaned: bool = False   # control socket closed; waiting for the process to be gone
    has_growth_board: bool = False   # its FD went with a growable reply (once per session)
    # Until its first message on the message channel the ROUTER does not know the session and
    # drops what is sent to it: growth notices wait here meanwhile (the newest per buffer).
    heard: bool = False
    unheard_growth: dict[str, dict] = field(default_factory=dict)

    def close_conn(self) -> None:
        if self.conn.fileno() >= 0:
            self.conn.close()

    def close(self) -> None:
        self.close_conn()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1
        self.backend.close()
