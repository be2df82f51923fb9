"""The broker's event loop: the control socket, the ZeroMQ ROUTER, and the pidfds of dead clients.

Single-threaded: one poll over every socket and FD. Signal handlers only set a flag (the wakeup FD
makes poll return). Nothing a client sends can raise out of the loop: each message is handled under
a guard that turns errors into an error reply (or, on the control socket, a disconnect).

Here: setting up and tearing down, the poll, and the message channel. The control socket's hellos
and FDs are ``control``'s, who is connected is ``sessions``', the open-file guard ``fdguard``'s,
what each request does ``handlers``', and what other sessions are told ``notices``'.
"""

from __future__ import annotations

import fcntl
import grp
import logging
import os
import signal
import socket
import stat
import time
from pathlib import Path

import zmq

from .. import fdpass, frames, paths, protocol
from .. import trace
from ..backend import Choice, broker_backend
from ..backend.base import BrokerBackend
from ..config import Config
from ..errors import AlreadyRunning, IpcPoolError, PeerRefused, ProtocolError, QuotaExceeded
from ..replies import GrowableState
from ..shm.leases import LeasePage
from . import collector
from .access import PoolAccess
from .arenas import Handoffs
from .checkpoints import CheckpointTable
from .control import ControlChannel
from .directory import Directories
from .durable import Durability
from .fdguard import FdGuard, raise_fd_limit
from .growables import GrowableTable
from .handlers import Handlers
from .metrics import Metrics
from .notices import Notices
from .objects import ObjectTable
from .outbox import Outbox
from .registry import Registry
from .replies import unexpected
from .session import Session
from .sessions import Sessions
from .systemd import Notifier
from .tables import Tables

log = logging.getLogger(__name__)

ZMQ_BACKLOG = 64     # message-channel connections the kernel queues for libzmq's accept
FD_TABLE = 16384     # open-file slots sized at start: sessions, chunks and pools (fdpass.presize_table)
STOCK_IDLE_S = 0.005   # the growth stock is refilled once no request came for this long
SPIN_SLICE_S = 100e-6  # while busy-polling, the idle pass runs once per this much quiet (``_spin``)
SOCKET_POLL_S = 10e-6  # ... and the sockets are polled this often, the request rings at every turn


def _prepare_dir(path: Path, group: int | None, mode: int) -> None:
    """The socket directory, ours, of ``group`` (None: as it is) and ``mode`` (its setgid bit
    kept): what the filesystem lets through must match what [access] admits."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise IpcPoolError(f"socket directory {path} is not a directory")
    if st.st_uid != os.getuid():
        raise IpcPoolError(f"socket directory {path} belongs to uid {st.st_uid}, not to us ({os.getuid()})")
    if group is not None and st.st_gid != group:
        _chgrp(path, group)
    if stat.S_IMODE(st.st_mode) & 0o777 != mode:
        os.chmod(path, mode | (st.st_mode & stat.S_ISGID))


def _chgrp(path: Path, group: int) -> None:
    try:
        os.chown(path, -1, group)
    except PermissionError:
        raise IpcPoolError(
            f"cannot give {path} to group {_group_name(group)} (socket_group, by default the first "
            f"[access] group): this user is not a member of it; add it, or set socket_group"
        ) from None


def _group_name(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name} ({gid})"
    except KeyError:
        return str(gid)


class Broker:
    def __init__(self, config: Config, choice: Choice, socket_dir: Path | None = None):
        self.config = config
        self.choice = choice
        self.socket_dir = paths.resolve(socket_dir or config.socket_dir)
        self.sessions: dict[bytes, Session] = {}      # token -> session
        self.session_table: Sessions | None = None
        self.fd_limit = 0
        self._poller = zmq.Poller()
        self._monitor = None
        self._stop = False
        # When the last request came: the loop polls without sleeping for busy_poll_us after it,
        # and the growth stock waits for a quiet spell (STOCK_IDLE_S).
        self._last_request = 0.0
        self._awake_told = 0   # the busy-poll deadline last told in the directories (ns, ``_tell_awake``)
        self.started = time.time()
        self.registry: Registry | None = None
        self.notifier = Notifier()
        self.metrics: Metrics | None = None
        self._status: tuple[int, int] | None = None
        # Made by start(), in this order; close() undoes whatever start() got to.
        self._lock_fd = -1
        self.backend: BrokerBackend | None = None
        self.durable: Durability | None = None
        self.growables: GrowableTable | None = None
        self.handoffs: Handoffs | None = None
        self.listener: socket.socket | None = None
        self.zctx: zmq.Context | None = None
        self.router: zmq.Socket | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None

    # -- set-up and tear-down -------------------------------------------------------------
    def start(self) -> None:
        """Take the directory lock, create pools, bind both sockets. Rolls back on failure."""
        _prepare_dir(self.socket_dir, self.config.socket_group, self.config.socket_mode)
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
            fdpass.presize_table(self._lock_fd, FD_TABLE)   # before the backend's threads start
            self.backend = broker_backend(self.choice.name)
            self.durable = Durability(self.notifier)
            self.registry = Registry(self.config, self.backend)
            self.registry.create_pools(self.durable)
            self.registry.on_pool_emptied = self._pool_emptied
            self.directories = Directories(self.registry, self.config.directory_entries)
            self.handoffs = Handoffs(self.registry, lambda session, note: self.send(session.token, note))
            self.objects = ObjectTable(self.registry, self.directories, self.handoffs)
            self.growables = GrowableTable(self.registry, self.config.growth_board)
            for name in self.registry.pools:   # a seal board and a name directory per pool, for the broker's life
                self.handoffs.board(name)
                self.directories.of(name)
            self.durable.tables(self.objects, self.growables)
            restored = self.objects.restore(self.durable.stored_objects(), self.durable.take_object_fds)
            self.registry.drop_empty_generations()
            regrown = self.growables.restore(self.durable.stored_growables(), self.durable.take_growable_fds)
            if restored or regrown:
                log.info("restored %d sealed object(s) and %d growable buffer(s) from the FD store", restored, regrown)
            self.growables.open_stocks(self.config.growth_stock)   # after what restored buffers hold
            if self.backend.durable:
                self.durable.store(self.registry)
                self.durable.save()
            self.notices = Notices(self.objects, self.sessions, self.send, self.directories.wake,
                                   lambda pool, word: self.handoffs.board(pool).wake(word))
            self.tables = Tables(self.registry, self.objects, self.growables, self.handoffs, self.durable,
                                 self.directories, CheckpointTable(self.registry))
            self.handlers = Handlers(tables=self.tables, notices=self.notices, sessions=self.sessions,
                                     backend_name=self.choice.name, started=self.started)
            # One state per object: a seal seen on the board is the broker's before any answer.
            self.objects.board_word = lambda pool, word: self.handoffs.board(pool).read(word)
            self.objects.on_board_seal = self.handlers.sealed
            self.session_table = Sessions(by_token=self.sessions, backend=self.backend, tables=self.tables,
                                          notices=self.notices, watch=self._watch, unwatch=self._unwatch)
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
        # Sockets 0660 (0666 where the directory lets others in), set before bind.
        old = os.umask(0o111 if self.config.socket_mode & 0o001 else 0o117)
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
            # No limit in messages on what is queued for a peer (past it ZeroMQ drops replies
            # without a word): the outbox bounds it in bytes. MANDATORY: a send to a peer that is
            # gone fails, and the outbox logs it.
            self.router.setsockopt(zmq.SNDHWM, 0)
            self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self.router.setsockopt(zmq.BACKLOG, ZMQ_BACKLOG)   # bounds a burst of connections
            self.router.bind(f"ipc://{endpoint}")
        finally:
            os.umask(old)
        self.outbox = Outbox(self.router, self.sessions, self.config, self._disconnect)
        self.session_table.outbox = self.outbox
        self.session_table.pending_per_uid = self.config.pending_hellos_per_uid
        self.access = PoolAccess(self.config, self.tables)
        if self.config.socket_group is not None:   # their group, whatever the directory's setgid bit
            for sock in (control, endpoint):
                _chgrp(sock, self.config.socket_group)
        # The router's monitor tells the guard of each message-channel connection (fdguard says why).
        self._monitor = self.router.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.guard = FdGuard(self.router, self._monitor, f"ipc://{endpoint}", self.fd_limit, self.session_table)
        self.control = ControlChannel(
            listener=self.listener, config=self.config, sessions=self.session_table, guard=self.guard,
            tables=self.tables, handlers=self.handlers,
            backend_name=self.choice.name, endpoint=f"ipc://{endpoint}", watch=self._watch, unwatch=self._unwatch,
            access=self.access, on_frame=self._on_frame, take_ring=self._take_ring,
        )
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
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
        if self.session_table is not None:
            self.session_table.close("broker shutting down")
        if self._monitor is not None:
            self.router.disable_monitor()
        for sock in (self._monitor, self.router):
            if sock is not None:
                sock.close(linger=0)
        self._monitor = self.router = None
        if self.zctx is not None:
            self.zctx.term()
            self.zctx = None
        if self.listener is not None:
            for p in (paths.CONTROL_NAME, paths.ZMQ_NAME):
                (self.socket_dir / p).unlink(missing_ok=True)
        for sock in (self.listener, self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()
        self.listener = self._wake_r = self._wake_w = None
        if self.durable is not None:
            self.durable.close()
            self.durable = None
        if self.handoffs is not None:
            self.handoffs.close()
            self.handoffs = None
        if getattr(self, "directories", None) is not None:
            self.directories.close()
            self.directories = None
        if self.growables is not None:
            self.growables.close_stocks()
            self.growables.close_board()
            self.growables = None
        if self.registry is not None:
            self.registry.close()
            self.registry = None
        if self.backend is not None:
            self.backend.close()
            self.backend = None
        if self._lock_fd >= 0:
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
        collector.start()
        try:
            while not self._stop:
                self.poll_once(timeout_ms)
                self.notifier.tick()
                self._report()
        finally:
            collector.stop()
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

    def _spin(self) -> dict:
        """Read the request rings and poll the sockets, without the idle pass between, until a
        socket has something or SPIN_SLICE_S passes. A frame arriving during an idle pass (sweeps,
        reports: ~10 µs on an H100 host with frees pending) waited for it, and a create's wait is
        a reader's."""
        poll, clock, rings = self._poller.poll, time.perf_counter, self._take_rings
        now = clock()
        until, next_poll = now + SPIN_SLICE_S, now
        while now < until:
            rings()
            if now >= next_poll:   # (a poll is a system call, which leaves the caches colder for
                events = poll(0)   # the next create: the rings are read more often than the sockets)
                if events:
                    return dict(events)
                next_poll = now + SOCKET_POLL_S
            now = clock()
        return {}

    def _tell_awake(self, until: float) -> None:
        """Tell the directories' readers the broker busy-polls until ``until`` (monotonic s), so that
        writers may put their creates in their request rings (``shm.requests``). Told in steps of
        0.1 ms: never later than the loop's own reckoning, which goes on for SPIN_SLICE_S more."""
        until_ns = int(until * 1e9)
        if until_ns > self._awake_told + 100_000:
            self._awake_told = until_ns
            self.directories.awake(until_ns)

    def _take_rings(self) -> bool:
        """The frames every session put in its request ring (``shm.requests``); whether any was waiting."""
        waiting = [(session, page) for session, page in self.directories.pages.items() if page.ring.waiting()]
        for session, page in waiting:
            self._take_page_ring(session, page)
        return bool(waiting)

    def _take_ring(self, session: Session) -> None:
        """The frames ``session`` put in its request ring, handled as frames from its socket,
        before anything else it sent; a ring that does not add up ends the session."""
        page = self.directories.pages.get(session)
        if page is not None:
            self._take_page_ring(session, page)

    def _take_page_ring(self, session: Session, page: LeasePage) -> None:
        if session.orphaned:
            return
        try:
            waiting = page.ring.take()
        except ProtocolError as exc:
            log.warning("session %d (pid %d): %s; disconnecting", session.sid, session.cred.pid, exc)
            self.control.send(session, protocol.error_reply(0, exc))
            self.session_table.orphan(session)
            return
        if not waiting:
            return
        session.framed = True
        for data in waiting:
            self._on_frame(session, data)
        self._last_request = time.monotonic()   # (requests: the busy-poll goes on after them)

    def _watch(self, fd: int) -> None:
        self._poller.register(fd, zmq.POLLIN)

    def _unwatch(self, fd: int) -> None:
        self._poller.unregister(fd)

    def poll_once(self, timeout_ms: int) -> None:
        deadline = self.objects.next_deadline()
        if deadline is not None:
            timeout_ms = max(0, min(timeout_ms, int((deadline - time.monotonic()) * 1000) + 1))
        if not self.guard.zmq_open:   # look again soon whether the message channel may open again
            timeout_ms = min(timeout_ms, 200)
        # After a get that parked, longer: its reader waits for a create, and a broker asleep when
        # it comes would add its own wake-up to the reader's (one spinner serves every reader). Both
        # only grow, so the loop never sleeps before a moment it told (``_tell_awake``).
        awake_until = max(self._last_request + self.config.busy_poll_us / 1e6,
                          self.objects.parked_at + self.config.busy_poll_parked_us / 1e6)
        spinning = time.monotonic() < awake_until
        if spinning:   # right after a request: don't sleep (busy_poll_us)
            timeout_ms = 0
            self._tell_awake(awake_until)
        else:
            collector.between_requests()   # (about to sleep: nobody waits)
            if self.registry is not None and self.backend.pending_frees:
                timeout_ms = min(timeout_ms, 2)   # frees wait on done events: look again soon
        # The growth stock is refilled while idle: after a burst of requests, not during one.
        # Making a chunk and its FD takes up to a millisecond, and a request arriving meanwhile
        # waits: a burst of grows (each one a request a few hundred µs after the last) must not
        # meet one, so the refill starts only once no request came for STOCK_IDLE_S.
        refill = not spinning and self.registry is not None and self.growables.stock_wanted()
        if refill:
            quiet_in = self._last_request + STOCK_IDLE_S - time.monotonic()
            refill = quiet_in <= 0
            timeout_ms = 0 if refill else min(timeout_ms, int(quiet_in * 1000) + 1)
        # Lease pages made ahead as the loop goes idle, one a turn (``Directories.stock_pages``).
        stock = not spinning and self.registry is not None and self.directories.pages_wanted()
        if stock:
            timeout_ms = 0
        if self._take_rings():   # (after the check above: a broker about to sleep looks at the rings
            timeout_ms = 0       # after the moment it told; frames there are requests: no sleep)
        events = dict(self._poller.poll(timeout_ms))
        if spinning and not events:
            events = self._spin()
        if self._wake_r.fileno() in events:
            try:
                self._wake_r.recv(4096)
            except BlockingIOError:
                pass
        if self._monitor in events:
            self.guard.on_monitor()
        if self.router in events:
            self._drain_router()
        if self.listener.fileno() in events:
            self.control.accept()
        table = self.session_table
        for fd in events:
            if isinstance(fd, int):
                if fd in table.pending:
                    self.control.on_hello(fd)
                elif fd in table.by_fd:
                    self.control.on_message(table.by_fd[fd])
                    if self.registry is not None:
                        self.growables.refill_quick()   # after the answer: while the client maps it
                    # A grow is a control request: the next one of a burst is read without a wake-up too.
                    self._last_request = time.monotonic()
                elif fd in table.by_pidfd:
                    table.process_gone(table.by_pidfd[fd])
        if table.pending:
            table.expire_pending()
        self.control.resume_accept()
        self.guard.recount()
        if self.registry is not None:
            try:   # the backend's failure here is logged: the loop serves on
                if not events and self.backend.pending_frees:
                    self.backend.sweep()
                if not events and refill:
                    self.growables.refill_stock()   # one chunk: a request arriving waits for one at most
                if not events and stock:
                    self.directories.stock_pages()
                self.handoffs.settle()   # ranges that went idle (in any sweep) back to their arenas
            except Exception as exc:   # noqa: BLE001
                unexpected(self.backend, exc, "idle pass")
        if deadline is not None:
            self.notices.timed_out(time.monotonic())

    # -- message channel ---------------------------------------------------------------------
    def _drain_router(self) -> None:
        for _ in range(1000):   # bounded, so the control socket is never starved
            try:
                parts = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.directories.received = time.perf_counter_ns()   # (a create's entry is timed from here)
            self._on_message([f.bytes for f in parts], _peer_uid(parts[-1]))
            self.handoffs.settle()   # a range a request made idle goes back before the next request
            self._last_request = time.monotonic()

    def send(self, ident: bytes, msg: dict) -> None:
        if trace.hook is not None:
            trace.emit("broker.send", ident=ident, msg=msg)
        self.outbox.send(ident, msg)

    def _disconnect(self, session: Session, why: str) -> None:
        """A session that does not read what it is sent: told why on its control socket, then
        treated as if it had closed it (its process may still hold memory: orphaned)."""
        if session.orphaned:
            return
        log.warning("session %d (pid %d uid %d) disconnected: %s", session.sid, session.cred.pid,
                    session.cred.uid, why)
        self.control.send(session, protocol.error_reply(0, QuotaExceeded(f"the broker ended this session: {why}")))
        self.session_table.orphan(session)

    def _reply(self, session: Session, op: str, rid: int, reply: dict | GrowableState) -> None:
        """An answer, unless the client could not take it (too large) or its session has no room
        for it: then an error naming the limit, and what the answer would have lent is let go."""
        if isinstance(reply, GrowableState):   # a growable op asked here: no FDs go with it
            reply = reply.encode()
        if trace.hook is not None:
            trace.emit("broker.reply", op=op, rid=rid, reply=reply, sid=session.sid)
        data = protocol.pack(protocol.ok_reply(rid, **reply))
        why = self.outbox.refusal(session, op, len(data))
        if why is None:
            self.outbox.send_packed(session, data)
            return
        self._undo(session, op, reply)
        log.info("session %d: %s", session.sid, why)
        self.outbox.send_packed(session, protocol.pack(protocol.error_reply(rid, QuotaExceeded(why))))

    def _undo(self, session: Session, op: str, reply: dict) -> None:
        """Let go of the leases (or the watch) a reply that is not sent would have given."""
        if op == "get_many":
            for aid in reply.get("alloc", ()):
                self.registry.free(session, aid)
        elif op == "get" and "alloc" in reply and not reply.get("pending"):
            self.registry.free(session, reply["alloc"])
        elif op == "watch":
            self.objects.unwatch(session, reply["watch"])

    def _on_frame(self, session: Session, data: bytes) -> None:
        """A hand-off request that came as a frame on the control socket (``ipcpool.frames``),
        answered on the message channel as the same request would be there. (A session sends
        frames only once it has an arena, asked for on the message channel: the ROUTER knows it.)
        A nudge, from the socket or a ring, asked only that the session's ring be read: done."""
        if data == frames.NUDGE_FRAME:
            return
        self.directories.received = time.perf_counter_ns()   # (a create's entry is timed from here)
        try:
            if not self._create_usual(session, data):
                c = frames.read_create(data)   # (the id, lengths and kind checked in its one unpack)
                if c is not None:
                    self._create(session, c)
                else:
                    op, fields = frames.parse(data)
                    self.access.check_request(session, op, fields)
                    self._run(session, op, fields, frames.request_id(data))
        except Exception as exc:   # (answered by the frame's id where it has a valid one)
            self._refuse(session.token, session, frames.request_id(data), exc)
        self.handoffs.settle()

    def _create_usual(self, session: Session, data: bytes) -> bool:
        """The usual create frame, checked up to its directory entry in C (``Handlers.create_usual``)
        and answered as ``_create`` answers; False: anything else, and every create where pools are
        restricted or the broker is traced (its events in order: ``ipcpool.trace``)."""
        if len(data) < 2 or data[1] != frames.CREATE or self.access.restricted or trace.hook is not None:
            return False   # (a seal, most often: nothing of the create's way for it)
        t0 = time.perf_counter()
        try:
            got = self.handlers.create_usual(session, data)
        except BaseException:
            self._created(session)
            raise
        if got is None:
            return False
        try:
            self._answer(session, "create", got[0], got[1], t0)
        finally:
            self._created(session)
        return True

    def _create(self, session: Session, c: frames.Create) -> None:
        """A create frame: no dict and no dispatch on the way to its directory entry, a reader's
        hand-off; traced (``broker.request`` in the message channel's fields), timed and answered
        as ``_run`` does."""
        self.access.check_pool(session, c.pool)
        t0 = time.perf_counter()
        if trace.hook is not None:
            trace.emit("broker.request", op="create", fields=c.fields(), sid=session.sid)
        try:
            self._answer(session, "create", c.rid, self.handlers.create(session, c), t0)
        finally:
            self._created(session)

    def _created(self, session: Session) -> None:
        session.backend.peer_progressed()
        collector.in_create()

    def _run(self, session: Session, op: str, fields: dict, rid: int) -> None:
        """A checked request of either channel handled, timed and answered (on the message channel)."""
        t0 = time.perf_counter()
        if trace.hook is not None:
            trace.emit("broker.request", op=op, fields=fields, sid=session.sid)
        try:
            self._answer(session, op, rid, self.handlers.handle(session, op, fields, rid), t0)
        finally:   # (after the answer: retiring events and sweeping frees wait for no reader)
            session.backend.peer_progressed()
            collector.between_requests()

    def _answer(self, session: Session, op: str, rid: int, reply: dict | GrowableState | None, t0: float) -> None:
        """A handled request (begun at ``t0``) traced, timed and answered; None: answered later."""
        if trace.hook is not None:
            trace.emit("broker.handled", op=op, sid=session.sid, reply=reply)
        if self.metrics is not None:
            self.metrics.observe(op, time.perf_counter() - t0)
        if reply is not None and op not in protocol.ONE_WAY:
            self._reply(session, op, rid, reply)

    def _refuse(self, ident: bytes, session: Session | None, rid: int, exc: Exception) -> None:
        """A request that failed, answered with its error (the backend's own failure, else a bug
        of ours, as an internal error: the broker serves on)."""
        who = f"session {session.sid}" if session else "unknown peer"
        if isinstance(exc, IpcPoolError):
            log.info("request from %s failed: %s", who, exc)
            if self.metrics is not None:
                self.metrics.error(exc)
        else:
            exc = unexpected(self.backend, exc, who)
        self.send(ident, protocol.error_reply(rid, exc))

    def _on_message(self, parts: list[bytes], peer_uid: int | None = None) -> None:
        ident = parts[0]
        session = self.sessions.get(ident)
        rid = 0
        try:
            if session is None:
                raise PeerRefused("unknown or expired session token; reconnect with ipcpool.connect()")
            if peer_uid is not None and peer_uid != session.cred.uid:
                log.warning("session %d's token came from uid %d's connection (the session is uid %d's); refused",
                            session.sid, peer_uid, session.cred.uid)
                raise PeerRefused("this session token belongs to another uid's session; connect with ipcpool.connect()")
            if not session.heard:
                self.notices.heard(session)
            if session.framed:   # frames it sent before this request are handled first
                self.control.drain(session)
            if len(parts) != 2:
                raise ProtocolError(f"expected one message frame, got {len(parts) - 1}")
            msg = protocol.unpack(parts[1])
            if "read" in msg:
                self.outbox.read(session, msg["read"])
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
                self.session_table.end(session, "bye after its control socket closed")
                return
            self.access.check_request(session, op, fields)
            self._run(session, op, fields, rid)
        except Exception as exc:
            self._refuse(ident, session, rid, exc)

def _peer_uid(frame: zmq.Frame) -> int | None:
    """The uid of the process at the other end of the message's connection: libzmq puts the
    ipc peer's SO_PEERCRED in "Peer-Address" ("host:uid:gid:pid"). None where it does not."""
    try:
        return int(frame.get("Peer-Address").split(":")[-3])
    except (zmq.ZMQError, ValueError, IndexError, AttributeError):
        return None
