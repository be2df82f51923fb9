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
    groups: tuple[int, ...] = ()   # supplementary groups at hello (per-pool access)
    # Bytes sent on the message channel and bytes the client says it took in (``read`` on its
    # requests): the difference sits in ZeroMQ's queues or the client's, charged to this session.
    sent_bytes: int = 0
    read_bytes: int = 0
    dropped_notices: int = 0   # notices not sent for want of room (told as an overflow notice)
    framed: bool = False   # it sends hand-off frames on its control socket (``ipcpool.frames``)

    @property
    def unread(self) -> int:
        return self.sent_bytes - self.read_bytes

    def close_conn(self) -> None:
        if self.conn.fileno() >= 0:
            self.conn.close()

    def close(self) -> None:
        self.close_conn()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1
        self.backend.close()
