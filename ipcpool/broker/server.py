"""The broker's event loop: the control socket, the ZeroMQ ROUTER, and the pidfds of dead clients.

Single-threaded: one poll over every socket and FD. Signal handlers only set a flag (the wakeup FD
makes poll return). Nothing a client sends can raise out of the loop: each message is handled under
a guard that turns errors into an error reply (or, on the control socket, a disconnect).
"""

from __future__ import annotations

import collections
import errno
import fcntl
import logging
import os
import resource
import secrets
import signal
import socket
import stat
import struct
import time
from pathlib import Path

import zmq

from .. import fdpass, paths, protocol
from ..backend import Choice, broker_backend
from ..config import Config
from ..errors import (
    AlreadyRunning,
    BrokerBusy,
    InternalError,
    InvalidRequest,
    IpcPoolError,
    PeerRefused,
    ProtocolError,
    QuotaExceeded,
    WaitTimeout,
)
from .durable import Durability
from .growables import GrowableTable
from .handlers import Handlers
from .handoff import Handoffs
from .metrics import Metrics
from .objects import ObjectTable
from .registry import Registry
from .session import Session
from .systemd import Notifier

log = logging.getLogger(__name__)

HELLO_TIMEOUT = 5.0
# Open files kept free: a new session takes three (its control socket, its pidfd, its ZeroMQ
# connection), and libzmq aborts the process when it cannot get one it needs.
FD_RESERVE_MIN = 64
MAX_PENDING = 1024   # connections that sent no hello yet
ZMQ_BACKLOG = 64     # message-channel connections the kernel queues for libzmq's accept
STRAY_ZMQ = 64       # message-channel connections beyond one per session tolerated


def raise_fd_limit() -> tuple[int, int]:
    """Take the hard limit of open files as ours (a broker serves many clients); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, want, exc)
    return soft, hard


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _prepare_dir(path: Path) -> None:
    path.mkdir(mode=0o750, parents=True, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise IpcPoolError(f"socket directory {path} is not a directory")
    if st.st_uid != os.getuid():
        raise IpcPoolError(f"socket directory {path} belongs to uid {st.st_uid}, not to us ({os.getuid()})")
    if st.st_mode & 0o027:  # never world-accessible, never group-writable
        os.chmod(path, 0o750)


class Broker:
    def __init__(self, config: Config, choice: Choice, socket_dir: Path | None = None):
        self.config = config
        self.choice = choice
        self.socket_dir = paths.resolve(socket_dir or config.socket_dir)
        self.sessions: dict[bytes, Session] = {}      # token -> session
        self._by_fd: dict[int, Session] = {}          # control conn fd -> session
        self._by_pidfd: dict[int, Session] = {}       # pidfd -> orphaned session
        self._pending: dict[int, tuple[socket.socket, float]] = {}  # accepted, no hello yet
        self._sessions_by_uid: collections.Counter = collections.Counter()
        self._accept_paused_until = 0.0   # out of FDs: stop accepting for a moment
        self.fd_limit = 0
        self._fd_count = 0          # open files when last counted,
        self._zmq_at_count = 0      # ... and message-channel connections then
        self._zmq_fds: set[int] = set()   # the message channel's connections (from its monitor)
        self._session_peak = 0      # the most sessions lately (clients that just closed may still
        self._peak_at = 0.0         # ... be connected on the message channel a moment)
        self._counted_at = 0.0
        self._zmq_open = True       # its listener accepts (closed while files run short)
        self._monitor = None
        self._next_sid = 1
        self._stop = False
        self._spin_until = 0.0   # poll without sleeping until then (busy_poll_us after a request)
        self.started = time.time()
        self.registry: Registry | None = None
        self.notifier = Notifier()
        self.metrics: Metrics | None = None
        self._status: tuple[int, int] | None = None

    # -- set-up and tear-down -------------------------------------------------------------
    def start(self) -> None:
        """Take the directory lock, create pools, bind both sockets. Rolls back on failure."""
        _prepare_dir(self.socket_dir)
        self._lock_fd = os.open(self.socket_dir / paths.LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        try:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                other = os.pread(self._lock_fd, 32, 0).decode(errors="replace").strip() or "?"
                raise AlreadyRunning(
                    f"another broker (pid {other}) already serves {self.socket_dir}; "
                    "stop it first or choose another --socket-dir"
                ) from None
            os.ftruncate(self._lock_fd, 0)
            os.pwrite(self._lock_fd, f"{os.getpid()}\n".encode(), 0)
            self.fd_limit, _ = raise_fd_limit()
            self.backend = broker_backend(self.choice.name)
            self.durable = Durability(self.notifier)
            self.registry = Registry(self.config, self.backend)
            self.registry.create_pools(self.durable)
            self.registry.on_pool_emptied = self._pool_emptied
            self.objects = ObjectTable(self.registry)
            self.growables = GrowableTable(self.registry)
            self.handoffs = Handoffs(self.registry, lambda session, note: self.send(session.token, note))
            for name in self.registry.pools:   # a seal board per pool, for the broker's life
                self.handoffs.board(name)
            self.durable.tables(self.objects, self.growables)
            restored = self.objects.restore(self.durable.stored_objects(), self.durable.take_object_fds)
            self.registry.drop_empty_generations()
            regrown = self.growables.restore(self.durable.stored_growables(), self.durable.take_growable_fds)
            if restored or regrown:
                log.info("restored %d sealed object(s) and %d growable buffer(s) from the FD store", restored, regrown)
            if self.backend.durable:
                self.durable.store(self.registry)
                self.durable.save()
            self.handlers = Handlers(self)
            self._bind()
            if self.config.metrics_address:
                self.metrics = Metrics(self.config.metrics_address)
        except BaseException:
            self.close()
            raise
        log.info(
            "broker ready: backend=%s (%s) dir=%s pools=%s",
            self.choice.name, self.choice.reason, self.socket_dir, ",".join(self.registry.pools),
        )
        for warning in self.backend.startup_warnings():
            log.warning("%s", warning)
        self.notifier.ready(self._status_line())

    def _bind(self) -> None:
        control = self.socket_dir / paths.CONTROL_NAME
        endpoint = self.socket_dir / paths.ZMQ_NAME
        for stale in (control, endpoint):  # we hold the lock: whatever is there is dead
            stale.unlink(missing_ok=True)
        old = os.umask(0o117)   # sockets 0660, set before bind
        try:
            self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            self.listener.bind(str(control))
            self.listener.listen(128)
            self.listener.setblocking(False)
            self.zctx = zmq.Context()
            self.router = self.zctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.setsockopt(zmq.RCVHWM, 100_000)
            self.router.setsockopt(zmq.BACKLOG, ZMQ_BACKLOG)   # bounds a burst of connections
            self.router.bind(f"ipc://{endpoint}")
            self._zmq_endpoint = f"ipc://{endpoint}"
        finally:
            os.umask(old)
        # libzmq accepts message-channel connections on its own thread, from anyone who can reach
        # the socket file, and aborts the process when accept() finds no free file (EMFILE). Its
        # monitor tells us of each connection (by FD), so the listener is closed before that can
        # happen: when connections outnumber sessions by more than STRAY_ZMQ, or files run short.
        self._monitor = self.router.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._poller = zmq.Poller()
        self._poller.register(self.router, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        for fd in (self.listener.fileno(), self._wake_r.fileno()):
            self._watch(fd)

    def _pool_emptied(self, pool) -> None:
        self.durable.unstore_pool(pool)
        self.durable.save()

    def _status_line(self) -> str:
        return f"{self.choice.name} backend, {len(self.sessions)} session(s), {len(self.objects.objects)} object(s)"

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        for s in list(self.sessions.values()):
            self._end_session(s, "broker shutting down")
        for conn, _ in self._pending.values():
            conn.close()
        self._pending.clear()
        if getattr(self, "_monitor", None) is not None:
            self.router.disable_monitor()
        for name in ("_monitor", "router"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(linger=0)
        if getattr(self, "zctx", None) is not None:
            self.zctx.term()
            self.zctx = None
        for name in ("listener", "_wake_r", "_wake_w"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close()
        if getattr(self, "listener", None) is not None:
            for p in (paths.CONTROL_NAME, paths.ZMQ_NAME):
                (self.socket_dir / p).unlink(missing_ok=True)
        if getattr(self, "durable", None) is not None:
            self.durable.close()
        if getattr(self, "handoffs", None) is not None:
            self.handoffs.close()
        if self.registry is not None:
            self.registry.close()
            self.registry = None
        if getattr(self, "backend", None) is not None:
            self.backend.close()
            self.backend = None
        if getattr(self, "_lock_fd", -1) >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        self.notifier.close()

    def request_stop(self, *_args) -> None:
        self._stop = True

    # -- the loop ---------------------------------------------------------------------------
    def serve_forever(self) -> None:
        old_wakeup = signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        old_handlers = {sig: signal.signal(sig, self.request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        # Wake at least twice per watchdog period, so a live loop never misses its WATCHDOG=1.
        wd = self.notifier.watchdog_interval
        timeout_ms = 1000 if wd is None else max(10, min(1000, int(wd * 1000)))
        try:
            while not self._stop:
                self.poll_once(timeout_ms)
                self.notifier.tick()
                self._report()
        finally:
            signal.set_wakeup_fd(old_wakeup)
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)
        self.notifier.stopping()
        log.info("broker stopping (%d sessions)", len(self.sessions))

    def _report(self) -> None:
        """STATUS= for systemd when it changed, metrics gauges about once a second."""
        counts = (len(self.sessions), len(self.objects.objects))
        if counts != self._status:   # the line is built only when it changes
            self._status = counts
            self.notifier.status(self._status_line())
        if self.metrics is not None:
            self.metrics.refresh(self)

    def _watch(self, fd: int) -> None:
        self._poller.register(fd, zmq.POLLIN)

    def _unwatch(self, fd: int) -> None:
        self._poller.unregister(fd)

    def poll_once(self, timeout_ms: int) -> None:
        deadline = self.objects.next_deadline()
        if deadline is not None:
            timeout_ms = max(0, min(timeout_ms, int((deadline - time.monotonic()) * 1000) + 1))
        if not self._zmq_open:   # look again soon whether the message channel may open again
            timeout_ms = min(timeout_ms, 200)
        if time.monotonic() < self._spin_until:   # right after a request: don't sleep (busy_poll_us)
            timeout_ms = 0
        elif self.registry is not None and self.backend.pending_frees:
            timeout_ms = min(timeout_ms, 2)   # frees wait on done events: look again soon
        events = dict(self._poller.poll(timeout_ms))
        if self._wake_r.fileno() in events:
            try:
                self._wake_r.recv(4096)
            except BlockingIOError:
                pass
        if self._monitor in events:
            self._on_monitor()
        if self.router in events:
            self._drain_router()
        if self.listener.fileno() in events:
            self._accept()
        for fd in events:
            if isinstance(fd, int):
                if fd in self._pending:
                    self._on_hello(fd)
                elif fd in self._by_fd:
                    self._on_control(self._by_fd[fd])
                elif fd in self._by_pidfd:
                    self._on_process_gone(self._by_pidfd[fd])
        if self._pending:
            self._expire_pending()
        if self._accept_paused_until and time.monotonic() >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self._watch(self.listener.fileno())
        if time.monotonic() - self._counted_at > (0.2 if not self._zmq_open else 2.0):
            self._guard_zmq_listener(self._fd_room())   # a recount now and then (events may be missed)
        if self.registry is not None:
            if not events and self.backend.pending_frees:
                self.backend.sweep()
            self.handoffs.settle()   # ranges that went idle (in any sweep) back to their arenas
        if deadline is not None:
            for name, w in self.objects.expired(time.monotonic()):
                self.send(w.session.token, protocol.error_reply(
                    w.rid, WaitTimeout(f"object {name!r} was not sealed within the timeout")))

    # -- control socket ----------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:   # EMFILE and friends: log, stop accepting a moment, keep serving
                log.error("accept failed: %s", exc)
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._pause_accept()
                return
            if len(self._pending) >= MAX_PENDING or self._fd_room() < self._fd_reserve() // 2:
                self._reply_and_drop(conn, BrokerBusy(
                    "the broker is near its limit of open files and takes no new session now; "
                    "retry later, or ask the operator to raise its LimitNOFILE"))
                continue
            conn.setblocking(False)
            self._pending[conn.fileno()] = (conn, time.monotonic())
            self._watch(conn.fileno())

    def _pause_accept(self) -> None:
        if self._accept_paused_until == 0.0:
            self._unwatch(self.listener.fileno())
        self._accept_paused_until = time.monotonic() + 0.1

    def _fd_reserve(self) -> int:
        return max(FD_RESERVE_MIN, self.fd_limit // 32)

    def _fd_room(self) -> int:
        """Open files left before the limit (counted: chunk and pool FDs come and go too)."""
        if not self.fd_limit:
            return 1 << 30
        self._fd_count, self._zmq_at_count, self._counted_at = open_fds(), len(self._zmq_fds), time.monotonic()
        return self.fd_limit - self._fd_count

    def _on_monitor(self) -> None:
        """Follow the message channel's connections; close its listener when they outnumber the
        sessions by more than STRAY_ZMQ (connections nobody will use), or files run short."""
        for _ in range(10_000):
            try:
                frames = self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames[0]) >= 6:
                event, fd = struct.unpack_from("=Hi", frames[0])
                if event == zmq.EVENT_ACCEPTED:
                    self._zmq_fds.add(fd)
                elif event == zmq.EVENT_DISCONNECTED:
                    self._zmq_fds.discard(fd)
        if self._zmq_open:
            stray = self._stray_zmq()
            estimate = self._fd_count + len(self._zmq_fds) - self._zmq_at_count
            if stray > STRAY_ZMQ or (self.fd_limit and self.fd_limit - estimate < self._fd_reserve()):
                self._guard_zmq_listener(self._fd_room())

    def _stray_zmq(self) -> int:
        """Message-channel connections beyond one per session (or session about to be, or that
        ended in the last two seconds)."""
        now = time.monotonic()
        if now - self._peak_at > 2.0:
            self._session_peak, self._peak_at = len(self.sessions), now
        return len(self._zmq_fds) - max(self._session_peak, len(self.sessions)) - len(self._pending)

    def _guard_zmq_listener(self, room: int) -> None:
        """Close the message channel's listener when connections outnumber sessions by more than
        STRAY_ZMQ or fewer than half the reserve of files is left (libzmq then drops the connections
        it accepted there: clients reconnect by themselves; a request in flight may be lost). Open
        it again once the strays are gone and the whole reserve is free. Meanwhile new sessions are
        refused (BrokerBusy)."""
        reserve = self._fd_reserve()
        stray = self._stray_zmq()
        if self._zmq_open and (room < reserve // 2 or stray > STRAY_ZMQ):
            log.warning("message channel closed to new connections: %d connections for %d sessions, "
                        "%d of %d open files in use", len(self._zmq_fds), len(self.sessions),
                        self._fd_count, self.fd_limit)
            self.router.unbind(self._zmq_endpoint)
            self._zmq_fds.clear()   # libzmq drops them all (and says nothing of each)
            self._zmq_open = False
        elif not self._zmq_open and room >= reserve and stray <= STRAY_ZMQ // 2:
            old = os.umask(0o117)
            try:
                self.router.bind(self._zmq_endpoint)
            finally:
                os.umask(old)
            self._zmq_open = True
            log.warning("message channel open to new connections again (%d of %d open files in use)",
                        self._fd_count, self.fd_limit)

    def _expire_pending(self) -> None:
        now = time.monotonic()
        for fd, (conn, since) in list(self._pending.items()):
            if now - since > HELLO_TIMEOUT:
                log.warning("dropping a connection that sent no hello in %.0f s", HELLO_TIMEOUT)
                del self._pending[fd]
                self._unwatch(fd)
                conn.close()

    def _reply_and_drop(self, conn: socket.socket, exc: IpcPoolError) -> None:
        try:
            fdpass.send(conn, protocol.error_reply(0, exc))
        except OSError:
            pass
        conn.close()

    def _on_hello(self, fd: int) -> None:
        conn, _ = self._pending.pop(fd)
        self._unwatch(fd)
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
            groups = fdpass.peer_groups(conn)
            if not self.config.allowed(cred.uid, cred.gid, groups):
                log.warning("refused pid %d uid %d gid %d groups %s: not allowed",
                            cred.pid, cred.uid, cred.gid, list(groups[:16]))
                raise PeerRefused(
                    f"uid {cred.uid} (gid {cred.gid}, {len(groups)} supplementary group(s)) is not "
                    "allowed to use this broker; ask the operator to add it to a group listed under "
                    "[access] in the broker's config (then log in again), or to list its uid"
                )
            cap = self.config.sessions_per_uid
            if cap and self._sessions_by_uid[cred.uid] >= cap:
                log.warning("refused pid %d uid %d: %d sessions, its limit", cred.pid, cred.uid, cap)
                raise QuotaExceeded(
                    f"uid {cred.uid} has {self._sessions_by_uid[cred.uid]} sessions, its limit "
                    "(sessions_per_uid in the broker's [limits]); close some clients first"
                )
            if self._fd_room() < self._fd_reserve() or not self._zmq_open:
                log.warning("refused pid %d uid %d: near the limit of %d open files", cred.pid, cred.uid,
                            self.fd_limit)
                raise BrokerBusy(
                    f"the broker is near its limit of {self.fd_limit} open files and takes no new "
                    "session now; retry later, or ask the operator to raise its LimitNOFILE"
                )
            pidfd = fdpass.peer_pidfd(conn, cred.pid)
        except BlockingIOError:
            self._pending[fd] = (conn, time.monotonic())
            self._watch(fd)
            return
        except IpcPoolError as exc:
            log.warning("control hello rejected: %s", exc)
            self._reply_and_drop(conn, exc)
            return
        except OSError as exc:
            log.warning("control hello failed: %s", exc)
            conn.close()
            return
        except Exception as exc:   # a bug of ours: drop this peer, keep serving
            log.exception("internal error handling a hello")
            self._reply_and_drop(conn, InternalError.of(exc))
            return
        session = Session(
            self._next_sid, secrets.token_bytes(16), cred, conn, pidfd, self.backend.open_session()
        )
        self._next_sid += 1
        self.sessions[session.token] = session
        self._sessions_by_uid[cred.uid] += 1
        self._session_peak = max(self._session_peak, len(self.sessions))
        self._by_fd[fd] = session
        self._watch(fd)
        log.info("session %d opened: pid %d uid %d", session.sid, cred.pid, cred.uid)
        self._send_control(session, protocol.ok_reply(
            0, token=session.token, session=session.sid, backend=self.choice.name,
            endpoint=f"ipc://{self.socket_dir / paths.ZMQ_NAME}", version=protocol.PROTOCOL_VERSION,
            pools=sorted(self.registry.pools),
        ))

    def _send_control(self, session: Session, msg: dict, fds: tuple[int, ...] = ()) -> None:
        try:
            fdpass.send(session.conn, msg, fds)
        except OSError as exc:
            log.info("session %d: control send failed (%s)", session.sid, exc)

    def _on_control(self, session: Session) -> None:
        try:
            got = fdpass.recv(session.conn, max_fds=0)
        except (BlockingIOError, InterruptedError):
            return
        except IpcPoolError as exc:
            log.warning("session %d: bad control message: %s; disconnecting", session.sid, exc)
            self._send_control(session, protocol.error_reply(0, exc))
            self._orphan(session)
            return
        except OSError:
            got = None
        if got is None:
            self._orphan(session)
            return
        msg, _ = got
        rid = protocol.request_id(msg)
        try:
            op, fields = protocol.validate(msg, protocol.CONTROL)
            if op == "pool_fd":   # the pool, and its seal board beside it
                pool = self.registry.pool(fields["pool"])
                board = self.handoffs.board(pool.spec.name)
                self._send_control(session, protocol.ok_reply(rid, info=pool.pool_info()), (pool.fd, board.fd))
            elif op == "chunk_fds":
                reply, fds = self._chunk_fds(session, fields)
                self._send_control(session, protocol.ok_reply(rid, **reply), tuple(fds))
            else:
                raise ProtocolError(f"{op} is not valid once the session is open")
        except IpcPoolError as exc:
            self._send_control(session, protocol.error_reply(rid, exc))
        except Exception as exc:   # a bug of ours: keep serving everyone else
            log.exception("session %d: internal error handling a control message", session.sid)
            self._send_control(session, protocol.error_reply(rid, InternalError.of(exc)))

    def _chunk_fds(self, session: Session, f: dict) -> tuple[dict, list[int]]:
        """At most FD_BATCH chunk FDs from chunk ``first``, with the sizes of the chunks they map."""
        first = f["first"]
        if "growable" in f:
            g, fds = self.growables.fds(session, f["growable"], first)
            chunks, one_file = g.memory.chunks, g.memory.one_file
        elif "alloc" in f:
            alloc = self.registry.held_by(session, f["alloc"])
            chunks, one_file = alloc.export.chunks, False
            if not 0 <= first < len(chunks):
                raise InvalidRequest(f"allocation {alloc.aid} has {len(chunks)} chunks, not chunk {first}")
            fds = alloc.pool.chunk_fds(alloc.handle)[first:]
        else:
            raise InvalidRequest("chunk_fds names a growable buffer or an allocation")
        if one_file:   # one file holds every chunk at its offset
            return {"chunks": list(chunks[first:])}, fds[:1]
        fds = fds[: protocol.FD_BATCH]
        return {"chunks": list(chunks[first : first + len(fds)])}, fds

    def _orphan(self, session: Session) -> None:
        """The control socket closed. After a bye, release now; otherwise wait until the process is
        gone (its GPU work may still touch the memory), then release."""
        if self._by_fd.pop(session.conn.fileno(), None) is not None:
            self._unwatch(session.conn.fileno())
        session.close_conn()
        if session.said_bye:
            self._end_session(session, "closed")
            return
        session.orphaned = True
        self._by_pidfd[session.pidfd] = session
        self._watch(session.pidfd)
        log.info("session %d: control socket closed without bye; waiting for pid %d to exit",
                 session.sid, session.cred.pid)

    def _on_process_gone(self, session: Session) -> None:
        # Its GPU work is over: done events it named but never completed must not hold frees back.
        session.backend.peer_gone()
        self._end_session(session, f"pid {session.cred.pid} exited")

    def _end_session(self, session: Session, why: str) -> None:
        if self.sessions.pop(session.token, None) is not None:
            uid = session.cred.uid
            self._sessions_by_uid[uid] -= 1
            if self._sessions_by_uid[uid] <= 0:
                del self._sessions_by_uid[uid]
        for fd, table in ((session.conn.fileno(), self._by_fd), (session.pidfd, self._by_pidfd)):
            if fd >= 0 and table.pop(fd, None) is not None:
                self._unwatch(fd)
        try:
            if self.registry is not None:
                self.handoffs.end_session(session)
                for g in self.growables.end_session(session):
                    self.durable.forget_growable(g)
                aborted, orphans = self.objects.end_session(session)
                for obj in aborted:
                    log.info("session %d: object %r aborted (never sealed)", session.sid, obj.name)
                    self.handlers.abandon(obj, [w for name, w in orphans if name == obj.name])
            released = self.registry.release_session(session) if self.registry else 0
        except Exception:
            log.exception("session %d: releasing its memory failed", session.sid)
            released = -1
        session.close()
        log.info("session %d ended (%s); released %d allocation(s)", session.sid, why, released)

    # -- message channel ---------------------------------------------------------------------
    def _drain_router(self) -> None:
        for _ in range(1000):   # bounded, so the control socket is never starved
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_message(frames)
            self.handoffs.settle()   # a range a request made idle goes back before the next request
            self._spin_until = time.monotonic() + self.config.busy_poll_us / 1e6

    def send(self, ident: bytes, msg: dict) -> None:
        try:
            self.router.send_multipart([ident, protocol.pack(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.info("reply dropped: %s", exc)

    def _on_message(self, frames: list[bytes]) -> None:
        ident = frames[0]
        session = self.sessions.get(ident)
        rid = 0
        try:
            if session is None:
                raise PeerRefused("unknown or expired session token; reconnect with ipcpool.connect()")
            if len(frames) != 2:
                raise ProtocolError(f"expected one message frame, got {len(frames) - 1}")
            msg = protocol.unpack(frames[1])
            if "id" not in msg:
                raise ProtocolError("missing field 'id'")
            rid = protocol.check_id(msg["id"])   # an invalid id is answered with 0, never executed
            op, fields = protocol.validate(msg, protocol.REQUESTS)
            if session.orphaned:
                # Its control socket is closed. A bye still ends it at once (the process says its
                # work is done: a client collected without close(), a peer the broker dropped);
                # anything else waits for the process to be gone.
                if op != "bye":
                    raise PeerRefused("unknown or expired session token; reconnect with ipcpool.connect()")
                self.send(ident, protocol.ok_reply(rid))
                session.said_bye = True
                self._end_session(session, "bye after its control socket closed")
                return
            t0 = time.perf_counter()
            try:
                reply = self.handlers.handle(session, op, fields, rid)
                if self.metrics is not None:
                    self.metrics.observe(op, time.perf_counter() - t0)
                if reply is not None and op not in protocol.ONE_WAY:   # None: answered later
                    self.send(ident, protocol.ok_reply(rid, **reply))
            finally:   # (after the answer: retiring events and sweeping frees wait for no reader)
                session.backend.peer_progressed()
        except IpcPoolError as exc:
            log.info("request from %s failed: %s", f"session {session.sid}" if session else "unknown peer", exc)
            if self.metrics is not None:
                self.metrics.error(exc)
            self.send(ident, protocol.error_reply(rid, exc))
        except Exception as exc:   # a bug of ours: keep serving, tell the client
            log.exception("internal error handling a request")
            self.send(ident, protocol.error_reply(rid, InternalError.of(exc)))
