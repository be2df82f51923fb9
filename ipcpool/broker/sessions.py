"""Who is connected: connections waiting for their hello, open sessions, and sessions whose
control socket closed (orphans) while their process still runs.

A session opens on a hello, and ends on a bye or once its process is gone (its pidfd becomes
readable): a process that only closed its control socket may still have GPU work touching the
memory it held. Ending a session lets go of everything it held, table by table.
"""

from __future__ import annotations

import collections
import logging
import secrets
import socket
import time
from collections.abc import Callable

from ..backend.base import BrokerBackend
from ..fdpass import PeerCred
from .notices import Notices
from .session import Session
from .tables import Tables

log = logging.getLogger(__name__)

HELLO_TIMEOUT = 5.0


class Sessions:
    def __init__(self, *, by_token: dict[bytes, Session], backend: BrokerBackend, tables: Tables,
                 notices: Notices, watch: Callable[[int], None], unwatch: Callable[[int], None]):
        self.tables = tables
        self.by_token = by_token   # token -> session (the message channel finds its sender here)
        self.by_fd: dict[int, Session] = {}      # control conn fd -> session
        self.by_pidfd: dict[int, Session] = {}   # pidfd -> orphaned session
        self.pending: dict[int, tuple[socket.socket, float]] = {}   # accepted, no hello yet
        self.by_uid: collections.Counter = collections.Counter()
        self._next_sid = 1
        self.backend = backend
        self.notices = notices
        self._watch = watch       # poll an FD (the server's poller)
        self._unwatch = unwatch

    # -- connections without a hello --------------------------------------------------------------
    def await_hello(self, conn: socket.socket) -> None:
        """An accepted (or not yet complete) connection: its hello is due within HELLO_TIMEOUT."""
        self.pending[conn.fileno()] = (conn, time.monotonic())
        self._watch(conn.fileno())

    def take_pending(self, fd: int) -> socket.socket:
        conn, _ = self.pending.pop(fd)
        self._unwatch(fd)
        return conn

    def expire_pending(self) -> None:
        now = time.monotonic()
        for fd, (conn, since) in list(self.pending.items()):
            if now - since > HELLO_TIMEOUT:
                log.warning("dropping a connection that sent no hello in %.0f s", HELLO_TIMEOUT)
                del self.pending[fd]
                self._unwatch(fd)
                conn.close()

    # -- sessions ---------------------------------------------------------------------------------
    def open(self, conn: socket.socket, cred: PeerCred, pidfd: int) -> Session:
        """A session for the peer that said hello on ``conn``."""
        session = Session(
            self._next_sid, secrets.token_bytes(16), cred, conn, pidfd, self.backend.open_session()
        )
        self._next_sid += 1
        self.by_token[session.token] = session
        self.by_uid[cred.uid] += 1
        self.by_fd[conn.fileno()] = session
        self._watch(conn.fileno())
        log.info("session %d opened: pid %d uid %d", session.sid, cred.pid, cred.uid)
        return session

    def orphan(self, session: Session) -> None:
        """The control socket closed. After a bye, end it now; otherwise wait until the process is
        gone (its GPU work may still touch the memory), then end it."""
        if self.by_fd.pop(session.conn.fileno(), None) is not None:
            self._unwatch(session.conn.fileno())
        session.close_conn()
        if session.said_bye:
            self.end(session, "closed")
            return
        session.orphaned = True
        self.by_pidfd[session.pidfd] = session
        self._watch(session.pidfd)
        log.info("session %d: control socket closed without bye; waiting for pid %d to exit",
                 session.sid, session.cred.pid)

    def process_gone(self, session: Session) -> None:
        # Its GPU work is over: done events it named but never completed must not hold frees back.
        session.backend.peer_gone()
        self.end(session, f"pid {session.cred.pid} exited")

    def end(self, session: Session, why: str) -> None:
        """Let go of all the session held: arenas, growables, objects it was writing (their
        waiting readers are told), every hold on an allocation; then close its FDs."""
        if self.by_token.pop(session.token, None) is not None:
            uid = session.cred.uid
            self.by_uid[uid] -= 1
            if self.by_uid[uid] <= 0:
                del self.by_uid[uid]
        for fd, table in ((session.conn.fileno(), self.by_fd), (session.pidfd, self.by_pidfd)):
            if fd >= 0 and table.pop(fd, None) is not None:
                self._unwatch(fd)
        try:
            self.tables.handoffs.end_session(session)
            for g in self.tables.growables.end_session(session):
                self.tables.durable.forget_growable(g)
            for v in self.tables.checkpoints.end_session(session):
                log.info("session %d: checkpoint %r version %d dropped (never published)", session.sid,
                         v.checkpoint, v.number)
            aborted, orphans = self.tables.objects.end_session(session)
            for obj in aborted:
                log.info("session %d: object %r aborted (never sealed)", session.sid, obj.name)
                self.notices.aborted(obj, [w for name, w in orphans if name == obj.name])
            freed = self.tables.registry.end_session(session)
        except Exception:
            log.exception("session %d: releasing its memory failed", session.sid)
            freed = -1
        session.close()
        log.info("session %d ended (%s); released %d allocation(s)", session.sid, why, freed)

    def close(self, why: str) -> None:
        """End every session and drop every connection without a hello."""
        for s in list(self.by_token.values()):
            self.end(s, why)
        for conn, _ in self.pending.values():
            conn.close()
        self.pending.clear()
