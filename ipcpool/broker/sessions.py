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

# A client says hello the moment it connects: a connection silent this long is dropped. Each uid
# has a few connections without a hello at most (``pending_hellos_per_uid``), and the broker
# MAX_PENDING in all: one more drops the oldest (of its uid, else of all), never the newcomer, so
# idle connections opened faster than they expire cannot keep an honest client out.
HELLO_TIMEOUT = 2.0
MAX_PENDING = 1024


class Sessions:
    def __init__(self, *, by_token: dict[bytes, Session], backend: BrokerBackend, tables: Tables,
                 notices: Notices, watch: Callable[[int], None], unwatch: Callable[[int], None]):
        self.tables = tables
        self.by_token = by_token   # token -> session (the message channel finds its sender here)
        self.by_fd: dict[int, Session] = {}      # control conn fd -> session
        self.by_pidfd: dict[int, Session] = {}   # pidfd -> orphaned session
        self.pending: dict[int, tuple[socket.socket, float, int]] = {}   # accepted, no hello yet (oldest first)
        self.pending_by_uid: dict[int, dict[int, None]] = {}   # uid -> its pending FDs, oldest first
        self.pending_per_uid = 64   # the config's pending_hellos_per_uid (set by the server)
        self.evicted = 0            # connections dropped for newer ones (logged now and then)
        self.by_uid: collections.Counter = collections.Counter()
        self._next_sid = 1
        self.backend = backend
        self.notices = notices
        self._watch = watch       # poll an FD (the server's poller)
        self._unwatch = unwatch
        self.outbox = None   # the server's (set once the message channel is bound): what ends is uncharged

    # -- connections without a hello --------------------------------------------------------------
    def await_hello(self, conn: socket.socket, uid: int, since: float | None = None) -> None:
        """An accepted (or not yet complete) connection of ``uid``: its hello is due within
        HELLO_TIMEOUT of ``since`` (its accept). The caller made room (``oldest_pending``)."""
        fd = conn.fileno()
        self.pending[fd] = (conn, time.monotonic() if since is None else since, uid)
        self.pending_by_uid.setdefault(uid, {})[fd] = None
        self._watch(fd)

    def take_pending(self, fd: int) -> tuple[socket.socket, float, int]:
        """A pending connection that became readable: (its socket, its accept time, its uid)."""
        got = self.pending.pop(fd)
        self._forget_uid(fd, got[2])
        self._unwatch(fd)
        return got

    def _forget_uid(self, fd: int, uid: int) -> None:
        mine = self.pending_by_uid.get(uid)
        if mine is not None:
            mine.pop(fd, None)
            if not mine:
                del self.pending_by_uid[uid]

    def oldest_pending(self, uid: int) -> int | None:
        """The connection to make room by before one more of ``uid`` waits for its hello: its
        uid's oldest where it has its share (pending_hellos_per_uid), else the oldest of all where
        MAX_PENDING wait; None where there is room."""
        mine = self.pending_by_uid.get(uid)
        if mine and len(mine) >= self.pending_per_uid:
            return next(iter(mine))
        if len(self.pending) >= MAX_PENDING:
            return next(iter(self.pending))
        return None

    def drop_pending(self, fd: int, why: str) -> None:
        self._drop_pending(fd, why)

    def _drop_pending(self, fd: int, why: str) -> None:
        conn, _, uid = self.take_pending(fd)
        conn.close()
        self.evicted += 1
        if self.evicted == 1 or self.evicted % 1000 == 0:
            log.warning("dropped a connection of uid %d without a hello (%s; %d so far)", uid, why, self.evicted)

    def expire_pending(self) -> None:
        """Drop the connections whose hello is overdue (the oldest come first: no full scan)."""
        now = time.monotonic()
        while self.pending:
            fd, (conn, since, uid) = next(iter(self.pending.items()))
            if now - since <= HELLO_TIMEOUT:
                return
            self._drop_pending(fd, f"no hello within {HELLO_TIMEOUT:g} s")

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
        if self.outbox is not None:
            self.outbox.forget(session)
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
            self.tables.directories.end_session(session)
        except Exception:
            log.exception("session %d: releasing its memory failed", session.sid)
            freed = -1
        session.close()
        log.info("session %d ended (%s); released %d allocation(s)", session.sid, why, freed)

    def close(self, why: str) -> None:
        """End every session and drop every connection without a hello."""
        for s in list(self.by_token.values()):
            self.end(s, why)
        for conn, _, _ in self.pending.values():
            conn.close()
        self.pending.clear()
        self.pending_by_uid.clear()
