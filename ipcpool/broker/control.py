"""The control socket: accepting connections, the hello (version, access check, per-uid cap,
room for one more session), and the FDs a session asks for (a pool with its seal board, chunks).

A growable buffer is made, attached and grown here too (the ops the message channel also serves),
so that the reply carries the chunk FDs the client lacks: one round trip instead of a request on
each socket. What the op does is ``handlers``' as on the message channel (other holders are told).
The session's first such reply also carries the growth board (``board``: its FD comes first).

Connections and hellos are refused, never crash the loop: a refusal is an error reply and a
close; an unexpected exception is logged with its traceback and reported as an ``InternalError``.
"""

from __future__ import annotations

import errno
import logging
import select
import socket
import time
from collections.abc import Callable

from .. import fdpass, frames, protocol
from ..config import Config
from ..errors import (
    BrokerBusy,
    InternalError,
    InvalidRequest,
    IpcPoolError,
    PeerRefused,
    ProtocolError,
    QuotaExceeded,
)
from ..replies import AllocFds, ChunkFds, GrowableState, Hello, PoolFds
from .access import PoolAccess
from .fdguard import FdGuard
from .handlers import Handlers
from .session import Session
from .replies import unexpected
from .sessions import Sessions
from .tables import Tables

log = logging.getLogger(__name__)

ACCEPT_BATCH = 32    # connections accepted per turn of the loop (a flood waits in the backlog)
LEND_FDS = 16        # chunks lent in one reply at most (a stock holds about one of each size)
READ_BATCH = 64      # control messages read from one session per turn of the loop (then the others')
DRAIN_MAX = 8192     # ... and before one of its message-channel requests (a socket buffer holds fewer)


class ControlChannel:
    def __init__(self, *, listener: socket.socket, config: Config, sessions: Sessions, guard: FdGuard,
                 tables: Tables, handlers: Handlers,
                 backend_name: str, endpoint: str, watch: Callable[[int], None], unwatch: Callable[[int], None],
                 access: PoolAccess, on_frame: Callable[[Session, bytes], None],
                 take_ring: Callable[[Session], None]):
        self.listener = listener
        self.on_frame = on_frame   # a hand-off frame: the broker answers it as a message-channel request
        self.take_ring = take_ring   # the frames of the session's request ring, which come first
        self.config = config
        self.sessions = sessions
        self.guard = guard
        self.tables = tables
        self.handlers = handlers
        self.backend_name = backend_name
        self.endpoint = endpoint   # of the message channel, told in the hello's reply
        self._watch = watch
        self._unwatch = unwatch
        self.access = access   # who may use which pool
        self._accept_paused_until = 0.0   # out of FDs: stop accepting for a moment

    # -- connections ------------------------------------------------------------------------------
    def accept(self) -> None:
        # A bounded batch per turn of the loop: the hellos already there are read before a flood
        # of new connections can push them out (see _make_room).
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:   # EMFILE and friends: log, stop accepting a moment, keep serving
                log.error("accept failed: %s", exc)
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._pause_accept()
                return
            if self.guard.room() < self.guard.reserve() // 2:
                _reply_and_drop(conn, BrokerBusy(
                    "the broker is near its limit of open files and takes no new session now; "
                    "retry later, or ask the operator to raise its LimitNOFILE"))
                continue
            try:
                uid = fdpass.peer_cred(conn).uid
            except OSError:
                conn.close()
                continue
            conn.setblocking(False)
            self._make_room(uid)
            self.sessions.await_hello(conn, uid)

    def _make_room(self, uid: int) -> None:
        """Before one more connection of ``uid`` waits for its hello: where its uid (or the broker)
        has its share waiting, the oldest goes: served, if its hello is there, else dropped."""
        for _ in range(4):   # (a served hello may leave the connection waiting again, at the end)
            fd = self.sessions.oldest_pending(uid)
            if fd is None:
                return
            if _readable(fd):
                self.on_hello(fd)
            else:
                self.sessions.drop_pending(fd, "its uid has too many connections without a hello")
        fd = self.sessions.oldest_pending(uid)
        if fd is not None:
            self.sessions.drop_pending(fd, "its uid has too many connections without a hello")

    def _pause_accept(self) -> None:
        if self._accept_paused_until == 0.0:
            self._unwatch(self.listener.fileno())
        self._accept_paused_until = time.monotonic() + 0.1

    def resume_accept(self) -> None:
        """Accept again once a pause (out of files) is over."""
        if self._accept_paused_until and time.monotonic() >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self._watch(self.listener.fileno())

    # -- the hello --------------------------------------------------------------------------------
    def on_hello(self, fd: int) -> None:
        conn, since, uid = self.sessions.take_pending(fd)
        try:
            got = fdpass.recv(conn, max_fds=0)
            if got is None:
                conn.close()
                return
            msg, _fds = got
            op, fields = protocol.validate(msg, protocol.CONTROL)
            if op != "hello":
                raise ProtocolError(f"expected hello, got {op}")
            if fields["version"] != protocol.PROTOCOL_VERSION:
                raise ProtocolError(
                    f"protocol version {fields['version']} is not served here (broker speaks "
                    f"{protocol.PROTOCOL_VERSION}); upgrade the client or the broker"
                )
            cred = fdpass.peer_cred(conn)
            groups = self._admit(conn, cred)
            pidfd = fdpass.peer_pidfd(conn, cred.pid)
        except BlockingIOError:
            self.sessions.await_hello(conn, uid, since)
            return
        except IpcPoolError as exc:
            log.warning("control hello rejected: %s", exc)
            _reply_and_drop(conn, exc)
            return
        except OSError as exc:
            log.warning("control hello failed: %s", exc)
            conn.close()
            return
        except Exception as exc:   # a bug of ours: drop this peer, keep serving
            log.exception("internal error handling a hello")
            _reply_and_drop(conn, InternalError.of(exc))
            return
        session = self.sessions.open(conn, cred, pidfd)
        session.groups = groups
        self.guard.session_opened()
        pools = self.access.allowed_pools(cred.uid, cred.gid, groups)   # only those it may use
        self.send(session, protocol.ok_reply(0, **Hello(
            session.token, session.sid, self.backend_name, self.endpoint, protocol.PROTOCOL_VERSION, tuple(pools),
            {name: self.tables.registry.pools[name].spec.device for name in pools}).encode()))

    def _admit(self, conn: socket.socket, cred: fdpass.PeerCred) -> tuple[int, ...]:
        """Refuse a peer whose uid and groups are not allowed, whose uid has its cap of sessions,
        or when the broker has no room for one more session."""
        groups = fdpass.peer_groups(conn)
        if not self.config.allowed(cred.uid, cred.gid, groups):
            log.warning("refused pid %d uid %d gid %d groups %s: not allowed",
                        cred.pid, cred.uid, cred.gid, list(groups[:16]))
            raise PeerRefused(
                f"uid {cred.uid} (gid {cred.gid}, {len(groups)} supplementary group(s)) is not "
                "allowed to use this broker: its config refused it (the filesystem let it reach the "
                "socket); ask the operator to add it to a group listed under [access] in the "
                "broker's config (then log in again), or to list its uid"
            )
        cap = self.config.sessions_per_uid
        if cap and self.sessions.by_uid[cred.uid] >= cap:
            log.warning("refused pid %d uid %d: %d sessions, its limit", cred.pid, cred.uid, cap)
            raise QuotaExceeded(
                f"uid {cred.uid} has {self.sessions.by_uid[cred.uid]} sessions, its limit "
                "(sessions_per_uid in the broker's [limits]); close some clients first"
            )
        if self.guard.room() < self.guard.reserve() or not self.guard.zmq_open:
            log.warning("refused pid %d uid %d: near the limit of %d open files", cred.pid, cred.uid,
                        self.guard.fd_limit)
            raise BrokerBusy(
                f"the broker is near its limit of {self.guard.fd_limit} open files and takes no new "
                "session now; retry later, or ask the operator to raise its LimitNOFILE"
            )
        return groups

    # -- an open session's control messages ------------------------------------------------------
    def send(self, session: Session, msg: dict, fds: tuple[int, ...] = ()) -> None:
        try:
            fdpass.send(session.conn, msg, fds)
        except OSError as exc:
            log.info("session %d: control send failed (%s)", session.sid, exc)

    def on_message(self, session: Session, limit: int = READ_BATCH) -> None:
        """What the session sent on its control socket: requests, and the hand-off's frames
        (``frames``: given to ``on_frame``), up to ``limit`` of them. Before one of its
        message-channel requests the broker takes in all it sent first (``drain``); bounded, so a
        session that sends faster than the broker reads cannot hold the loop (past the bound only
        its own requests lose their order)."""
        for _ in range(limit):
            msg = self._read_one(session)
            # The ring is read after the socket: a frame put there before this message was sent
            # is then in it (read before, it could miss one put meanwhile, and the message, a seal
            # on the socket say, would overtake its create in the ring).
            self.take_ring(session)
            if msg is None or session.orphaned:
                return
            self._handle(session, msg)

    def drain(self, session: Session) -> None:
        self.on_message(session, DRAIN_MAX)

    def _read_one(self, session: Session) -> bytes | dict | None:
        """One message read (a frame's bytes, or a request); None where none was waiting (or the
        session ended)."""
        try:
            got = fdpass.recv_raw(session.conn, max_fds=0)
            if got is not None and not frames.is_frame(got[0]):
                got = protocol.unpack(got[0]), got[1]
        except (BlockingIOError, InterruptedError):
            return None
        except IpcPoolError as exc:
            log.warning("session %d: bad control message: %s; disconnecting", session.sid, exc)
            self.send(session, protocol.error_reply(0, exc))
            self.sessions.orphan(session)
            return None
        except OSError:
            got = None
        if got is None:
            self.sessions.orphan(session)
            return None
        return got[0]

    def _handle(self, session: Session, msg: bytes | dict) -> None:
        if isinstance(msg, bytes):
            session.framed = True   # (its arena set it already; a frame from a client without one too)
            self.on_frame(session, msg)
        else:
            self._request(session, msg)

    def _request(self, session: Session, msg: dict) -> None:
        rid = protocol.request_id(msg)
        try:
            op, fields = protocol.validate(msg, protocol.CONTROL)
            self.access.check_request(session, op, fields)
            if op == "pool_fd":   # the pool, its seal board, its name directory and a lease page
                pool = self.tables.registry.pool(fields["pool"])
                self.access.check(session, pool.spec.name)
                board = self.tables.handoffs.board(pool.spec.name)
                fds, sent = [pool.fd, board.fd], PoolFds(pool.pool_info())
                directories = self.tables.directories
                directory = directories.of(pool.spec.name)
                if directory is not None:
                    fds.append(directory.fd)
                    page = directories.page(session, pool.spec.name)
                    if page is not None:   # once per session
                        fds.append(page.fd)
                    sent = PoolFds(sent.info, directory.capacity, directories.pool_index[pool.spec.name], page is not None)
                self.send(session, protocol.ok_reply(rid, **sent.encode()), tuple(fds))
            elif op == "chunk_fds":
                chunks, fds = self._chunk_fds(session, fields)
                self.send(session, protocol.ok_reply(rid, **chunks.encode()), tuple(fds))
            elif op == "alloc_fds":
                counts, fds = self._alloc_fds(session, fields["allocs"])
                self.send(session, protocol.ok_reply(rid, **counts.encode()), tuple(fds))
            elif op in protocol.GROWABLE_CONTROL:
                reply = self.handlers.handle(session, op, fields, rid)
                self._growable_reply(session, op, fields, rid, reply)
            else:
                raise ProtocolError(f"{op} is not valid once the session is open")
        except IpcPoolError as exc:
            self.send(session, protocol.error_reply(rid, exc))
        except Exception as exc:   # the backend's own failure, else a bug of ours: keep serving
            err = unexpected(self.sessions.backend, exc, f"session {session.sid} (control)")
            self.send(session, protocol.error_reply(rid, err))

    def _growable_reply(self, session: Session, op: str, f: dict, rid: int, reply: GrowableState) -> None:
        """A growable op's answer with its FDs: the growth board's (the session's first such
        reply: ``board``), the chunks' from the client's ``first`` on (those it did not just take
        from its loan: ``batch``), then chunks lent to it after a create or grow (``lend``)."""
        g = self.tables.growables.attached(session, f["name"])
        first = f.get("first", 0) + (len(f["loan"]) if reply.took else 0)
        chunks = g.memory.chunks
        fds = g.memory.fds(first) if first < len(chunks) else []
        board = self.tables.growables.board
        head: tuple[int, ...] = ()
        if board is not None and not session.has_growth_board:
            head = (board.fd,)
            session.has_growth_board = True
        batch, fds = _fd_batch(chunks, g.memory.one_file, first, fds, protocol.FD_BATCH - len(head))
        lent, lend, pool, info = [], None, None, None
        if op in ("grow_create", "grow") and len(head) + len(fds) + LEND_FDS <= protocol.FD_BATCH:
            lent = self.tables.growables.lend(session, g, LEND_FDS)
            lend = [[lid, c.size] for lid, c in lent]
            if lent and reply.info is None:   # a grow's reply: the loan's pool and device
                pool, info = g.pool, g.memory.info()
        sent = reply.as_sent(bool(head), batch, lend, pool, info)
        self.send(session, protocol.ok_reply(rid, **sent.encode()), (*head, *fds, *(c.fd for _, c in lent)))

    def _chunk_fds(self, session: Session, f: dict) -> tuple[ChunkFds, list[int]]:
        """At most FD_BATCH chunk FDs from chunk ``first``, with the sizes of the chunks they map."""
        first = f["first"]
        if "growable" in f:
            g, fds = self.tables.growables.fds(session, f["growable"], first)
            chunks, one_file = g.memory.chunks, g.memory.one_file
        elif "alloc" in f:
            alloc = self._held(session, f["alloc"])
            self.access.check(session, alloc.pool.spec.name)
            chunks, one_file = alloc.export.chunks, False
            if not 0 <= first < len(chunks):
                raise InvalidRequest(f"allocation {alloc.aid} has {len(chunks)} chunks, not chunk {first}")
            fds = alloc.pool.chunk_fds(alloc.handle)[first:]
        else:
            raise InvalidRequest("chunk_fds names a growable buffer or an allocation")
        batch, fds = _fd_batch(chunks, one_file, first, fds)
        return ChunkFds(batch), fds


    def _alloc_fds(self, session: Session, aids: list[int]) -> tuple[AllocFds, list[int]]:
        """Every chunk FD of each allocation in ``aids``, in order, and how many each has."""
        counts, fds = [], []
        for aid in aids:
            alloc = self._held(session, aid)
            self.access.check(session, alloc.pool.spec.name)
            got = alloc.pool.chunk_fds(alloc.handle)
            counts.append(len(got))
            fds += got
        if len(fds) > protocol.FD_BATCH:
            raise InvalidRequest(f"those allocations have {len(fds)} chunk FDs; one reply carries at most "
                                 f"{protocol.FD_BATCH} (ask for fewer at once, or use chunk_fds)")
        return AllocFds(counts), fds

    def _held(self, session: Session, aid: int):
        # An arena is held by the arena, not the session: its slab's FD is the session's too.
        return self.tables.handoffs.arena_alloc(session, aid) or self.tables.registry.held_by(session, aid)


def _fd_batch(chunks: list[int], one_file: bool, first: int, fds: list[int],
              most: int = protocol.FD_BATCH) -> tuple[list[int], list[int]]:
    """Of ``fds``, those of chunks ``first`` onwards, what one reply carries (at most ``most``),
    and the sizes of the chunks they map. One file holding every chunk at its offset is one FD."""
    if first >= len(chunks):
        return [], []
    if one_file:
        return list(chunks[first:]), fds[:1]
    fds = fds[:most]
    return list(chunks[first : first + len(fds)]), fds


def _readable(fd: int) -> bool:
    waiter = select.poll()   # (not select(): FDs past 1024)
    waiter.register(fd, select.POLLIN)
    return bool(waiter.poll(0))


def _reply_and_drop(conn: socket.socket, exc: IpcPoolError) -> None:
    try:
        fdpass.send(conn, protocol.error_reply(0, exc))
    except OSError:
        pass
    conn.close()
