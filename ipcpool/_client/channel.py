"""A client's two sockets to the broker, and who takes what comes back.

A client opens the control socket (hello -> session token), then a ZeroMQ DEALER whose routing id
is that token. Requests go over ZeroMQ; pool FDs come once per pool over the control socket. The
control socket also tells us the broker died: EOF there while we wait for a reply is BrokerGone.

Requests carry ids, and several may be out at once (creates and seals are sent without waiting),
so what arrives is sorted here: the reply awaited; a reply to a request sent without waiting (the
hand-off's, ``on_reply``); a late error of a one-way request (``async_errors``); a notice: a
reclaim, seal or abort for the hand-off (``on_notice``), a grown buffer (``on_grown``), a seal
under a watched prefix (queued in ``watches``). The parts of the client set those hooks.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import socket
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path

import zmq

from .. import fdpass, frames, paths, protocol
from .. import trace
from ..shm import fence, requests
from ..errors import BrokerGone, ClosedError, InvalidRequest, IpcPoolError, PeerRefused, ProtocolError
from ..fds import close_all
from ..replies import AllocFds, ChunkFds, Hello, WatchNotice
from .settings import Settings
from .waitlog import SlowWait, describe

log = logging.getLogger(__name__)

_BYE_ID = (1 << 63) - 1   # a request id no Channel.send reaches
FD_TABLE = 1024   # open-file slots sized at connect (fdpass.presize_table)
ACK_EVERY = 1 << 20   # bytes taken in unasked (notices) after which the broker is told (an ack)
ALIVE_CHECK_S = 0.005   # a send looks whether the broker closed the control socket this often


class _NotYet(Exception):
    """A reply to an earlier request arrived first; keep waiting for ours."""


def _close_unclosed(pid: int, dealer: zmq.Socket, control: socket.socket,
                    unraised: collections.deque) -> None:
    """A Client collected (or left at exit) without close(): end its session as close() would,
    by a bye the broker answers before the control socket closes, so the broker releases what the
    session held at once instead of waiting for this process to exit. Runs from weakref.finalize:
    never touches the Client itself. In a forked child (another pid) the session is not ours to
    end: nothing is sent. Refusals of requests sent without waiting, those ``unraised`` and those
    that arrive before the bye's answer, are warned about: nothing is lost without a word."""
    if os.getpid() != pid:
        return
    try:
        if not dealer.closed and control.fileno() >= 0:
            dealer.send(protocol.pack({"op": "bye", "id": _BYE_ID}), zmq.NOBLOCK)
            poller = zmq.Poller()
            poller.register(dealer, zmq.POLLIN)
            poller.register(control.fileno(), zmq.POLLIN)
            deadline = time.monotonic() + 2.0
            while (left := deadline - time.monotonic()) > 0:
                events = dict(poller.poll(int(left * 1000) + 1))
                if dealer not in events:
                    break   # the broker went away (control readable), or no answer in time
                reply = protocol.unpack(dealer.recv(zmq.NOBLOCK), protocol.MAX_REPLY)
                if reply.get("id") == _BYE_ID:
                    break
                if "notify" not in reply and not reply.get("ok"):
                    unraised.append(protocol.refusal(reply))
    except (zmq.ZMQError, IpcPoolError, OSError):
        pass   # a broker that is gone has nothing to release
    finally:
        if not dealer.closed:
            dealer.close(linger=0)
        control.close()
    if unraised:   # a RuntimeWarning: shown by default, unlike a ResourceWarning
        warnings.warn(f"ipcpool.Client collected unclosed: the broker refused {len(unraised)} request(s) "
                      f"sent without waiting, the first: {unraised[0]}", RuntimeWarning, stacklevel=2)
    warnings.warn("ipcpool.Client was not closed (its session was ended when it was collected); "
                  "use `with ipcpool.connect() as c:`", ResourceWarning, stacklevel=2)


class Channel:
    """One session's sockets. Every part of the client holds it; it holds none of them, only the
    hooks they set. It lives as long as anything of the session does (buffers hold it through
    their lease table), and a channel collected unclosed ends its session."""

    def __init__(self, socket_dir: Path, timeout: float, settings: Settings):
        self.socket_dir = socket_dir
        self.timeout = timeout
        self.spin_s = settings.spin_s
        self.get_spin_s = settings.get_spin_s
        self.lock = threading.RLock()
        # Work a call does while its reply is on its way, at most a round trip's worth; it raises
        # nothing (``Handoff.ready_more``: a steady writer's next carve, made where it waits anyway).
        self.idle: Callable[[], None] | None = None
        self.closed = False
        self._last_sent = 0       # the id of the newest request on the message channel ...
        self._last_answered = 0   # ... and of the newest one answered (all before it were read)
        self._next_id = 1
        self.framed: set[int] = set()   # frames sent (``send_frame``) and not answered yet
        # The last frame sent on the socket while unanswered: until then frames go there too (the
        # broker reads a ring before the socket, so a frame put in the ring would overtake it).
        self._on_socket = 0
        self.async_errors: list[IpcPoolError] = []
        # What the broker refused of requests sent without waiting and nobody has raised yet: the
        # next create, allocate, seal, flush or close raises the first (a finalizer warns).
        self.unraised: collections.deque[IpcPoolError] = collections.deque()
        self.watches: dict[int, collections.deque] = {}   # watch id -> seals announced, not yet taken
        self.watch_prefixes: dict[int, str] = {}   # watch id -> its prefix (one notice serves them all)
        self.watch_dropped = 0   # seals the broker did not announce for want of room (we read too slowly)
        # Bytes taken in from the message channel, and the count last told to the broker: what
        # it holds for us unread is bounded (``broker.outbox``), so it must learn what we read.
        self._read_bytes = 0
        self._told_read = 0
        self._gone: str | None = None   # why the session is over, once we know (BrokerGone after)
        self._alive_at = 0.0
        # Set by the client's parts: what arrives unasked goes there.
        self.on_reply: Callable[[dict], bool] = lambda msg: False    # True: a reply the hook consumed
        self.on_notice: Callable[[dict], bool] = lambda msg: False   # True: a notice the hook consumed
        self.on_grown: Callable[[dict], None] = lambda msg: None
        self.on_progress: Callable[[], None] = lambda: None  # any reply: the broker moved on (R4)
        self._control = self._open_control()
        # Room for the FDs replies bring (a batch of chunks, a loan) before the zmq threads start.
        fdpass.presize_table(self._control.fileno(), FD_TABLE)
        fence.registered()   # starts it now, on a thread: readers use directories once it is done
        # Non-blocking from here: a request or a reply that is ready is one system call (in
        # timeout mode Python polls before each), waits are polls of our own (_control_io).
        self._control.setblocking(False)
        try:
            hello = self._hello()
            self.session: int = hello.session
            self.backend_name: str = hello.backend
            self.pool_names = hello.pools
            self.pool_devices = hello.devices   # each pool's device (a growable's mapping is made ahead)
            self._zctx = zmq.Context.instance()
            self._dealer = self._zctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.IDENTITY, hello.token)
            self._dealer.setsockopt(zmq.LINGER, 1000)
            self._dealer.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_REPLY)
            # Replies are never dropped on our side for their number (the broker bounds their bytes),
            # and a send waits for room no longer than our timeout.
            self._dealer.setsockopt(zmq.RCVHWM, 0)
            self._dealer.setsockopt(zmq.SNDTIMEO, max(1, int(self.timeout * 1000)))
            self._dealer.connect(self._check_endpoint(hello.endpoint))
            self._poller = zmq.Poller()
            self._poller.register(self._dealer, zmq.POLLIN)
            self._poller.register(self._control.fileno(), zmq.POLLIN)
        except BaseException:
            self._control.close()
            raise
        self._finalizer = weakref.finalize(self, _close_unclosed, os.getpid(), self._dealer, self._control,
                                           self.unraised)
        self._ping = self.send("ping")   # not waited for (see settle)

    # -- session set-up -----------------------------------------------------------------------
    def _open_control(self) -> socket.socket:
        path = self.socket_dir / paths.CONTROL_NAME
        deadline = time.monotonic() + self.timeout
        pause = 0.001
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            try:
                sock.settimeout(self.timeout)
                sock.connect(str(path))
                return sock
            except BlockingIOError as exc:
                # EAGAIN: the broker's listen backlog is full (a burst of clients, a busy broker).
                # It is there: try again until our timeout, backing off.
                sock.close()
                if time.monotonic() + pause > deadline:
                    raise BrokerGone(
                        f"the broker at {path} accepted no connection within {self.timeout:g} s "
                        "(its listen backlog stayed full)"
                    ) from exc
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                sock.close()
                raise BrokerGone(
                    f"no broker is serving {self.socket_dir} ({exc.strerror}); start one with "
                    "`ipcpool broker`, or point IPCPOOL_SOCKET_DIR at the directory it serves"
                ) from exc
            except PermissionError as exc:
                sock.close()
                raise PeerRefused(f"permission denied on {path}: {paths.why_denied(path)}") from exc
            except OSError as exc:
                sock.close()
                raise BrokerGone(f"cannot connect to the broker at {path}: {exc}") from exc

    @staticmethod
    def _check_endpoint(endpoint: str) -> str:
        # ZeroMQ retries a refused ipc connect silently; say it plainly instead of timing out later.
        path = endpoint.removeprefix("ipc://")
        if endpoint.startswith("ipc://") and not os.access(path, os.R_OK | os.W_OK):
            raise PeerRefused(f"permission denied on {path} (the broker's message channel): "
                              f"{paths.why_denied(Path(path))}")
        return endpoint

    def _hello(self) -> Hello:
        reply, fds = self.control_call({"op": "hello", "version": protocol.PROTOCOL_VERSION, "pid": os.getpid()})
        for fd in fds:
            os.close(fd)
        return Hello.decode(reply)

    # -- the control socket: FDs --------------------------------------------------------------
    @trace.phase("control")
    def control_call(self, msg: dict) -> tuple[dict, list[int]]:
        """A request on the control socket and its reply, with the FDs it carries (owned by the
        caller; closed here when the reply is an error)."""
        self.control_send(msg)
        return self.control_recv()

    def control_send(self, msg: dict) -> None:
        """The first half of ``control_call``: the caller may work while the broker answers."""
        try:
            self._control_io(fdpass.send, select.POLLOUT, msg)
        except (ConnectionError, BrokenPipeError):
            pass   # closed by the broker: the reply it sent first (why) may still be there to read
        except TimeoutError as exc:
            raise BrokerGone(f"the broker did not read a request within {self.timeout:.0f} s") from exc

    def control_recv(self) -> tuple[dict, list[int]]:
        """The second half of ``control_call``: the reply to the request sent."""
        try:
            got = self._control_reply()
        except TimeoutError as exc:
            raise BrokerGone(f"the broker did not answer within {self.timeout:.0f} s") from exc
        except (ConnectionError, BrokenPipeError) as exc:
            raise BrokerGone("the broker closed the connection") from exc
        if got is None:
            raise BrokerGone("the broker closed the connection")
        reply, fds = got
        if not reply.get("ok"):
            for fd in fds:
                os.close(fd)
            raise protocol.refusal(reply)
        return reply, fds

    def _control_reply(self) -> tuple[dict, list[int]] | None:
        """The control socket's next message: tried without sleeping for ``spin_s`` first, one
        system call a try (a grow is answered within tens of microseconds; a sleeping process
        wakes up slower than that), then waited for."""
        spin_until = time.perf_counter() + self.spin_s
        while True:
            try:
                return fdpass.recv(self._control)
            except BlockingIOError:
                if time.perf_counter() >= spin_until:
                    return self._control_io(fdpass.recv, select.POLLIN)

    def _control_io(self, call: Callable, event: int, *args):
        """``call(control socket, *args)``, the socket non-blocking: waiting for ``event`` (poll)
        while it would block, up to the timeout (then TimeoutError)."""
        deadline = None
        while True:
            try:
                return call(self._control, *args)
            except BlockingIOError:
                now = time.monotonic()
                deadline = deadline or now + self.timeout
                if now >= deadline:
                    raise TimeoutError from None
                waiter = select.poll()
                waiter.register(self._control.fileno(), event)
                waiter.poll(max(1, int((deadline - now) * 1000)))

    def answered(self, rid: int) -> bool:
        """Whether the message channel's request ``rid`` was answered (and all before it)."""
        return rid <= self._last_answered

    def settle(self) -> None:
        """Before a request on the control socket that must come after what this session sent on
        the message channel. The two sockets are not ordered: a free sent without waiting may
        still be on its way when a grow that needs its room arrives. A ping settles it, sent only
        when a message is unanswered. The connect's own ping is not waited for: nothing came
        before it, and the growth notices the broker has for a session it has not heard from on
        the message channel wait there until it has (``broker.notices``)."""
        if self._last_sent <= self._last_answered or self._last_sent == self._ping:
            return
        self.drain()
        if self._last_sent > self._last_answered:
            self.call("ping")

    def chunk_fds(self, first: int, **which) -> tuple[list[int], list[int]]:
        """One batch of chunk FDs over the control socket, of a growable buffer or a VMM-backed
        allocation, from chunk ``first``: (the sizes of the chunks they map, the FDs)."""
        reply, fds = self.control_call({"op": "chunk_fds", "first": first, **which})
        return ChunkFds.decode(reply).chunks, fds

    def alloc_fds(self, aid: int, count: int) -> list[int]:
        """All ``count`` chunk FDs of a VMM-backed allocation, batch by batch."""
        out: list[int] = []
        try:
            while len(out) < count:
                _, fds = self.chunk_fds(len(out), alloc=aid)
                if not fds:
                    raise ProtocolError(f"allocation {aid}: the broker sent no chunk FDs")
                out += fds
        except BaseException:
            for fd in out:
                os.close(fd)
            raise
        return out

    def allocs_fds(self, wanted: list[tuple[int, int]]) -> dict[int, list[int]]:
        """The chunk FDs of several VMM-backed allocations, ``(alloc, count)`` each: as many as
        fit in one reply per round trip (``alloc_fds``); one too large alone goes batch by batch."""
        out: dict[int, list[int]] = {}
        groups: list[list[int]] = [[]]
        held = 0
        try:
            for aid, count in wanted:
                if count > protocol.FD_BATCH:
                    out[aid] = self.alloc_fds(aid, count)
                    continue
                if held + count > protocol.FD_BATCH:
                    groups.append([])
                    held = 0
                groups[-1].append(aid)
                held += count
            for group in filter(None, groups):
                reply, fds = self.control_call({"op": "alloc_fds", "allocs": group})
                counts = AllocFds.decode(reply).counts
                bad = len(counts) != len(group) or sum(counts) != len(fds)
                for aid, n in zip(group, counts):
                    out[aid], fds = fds[:n], fds[n:]
                if bad:
                    close_all(fds)
                    raise ProtocolError("alloc_fds reply: its counts do not match its FDs")
        except BaseException:
            close_all(fd for fds in out.values() for fd in fds)
            raise
        return out

    # -- requests -----------------------------------------------------------------------------
    def check_open(self) -> None:
        if self.closed:
            raise ClosedError("this ipcpool client is closed")

    def send(self, op: str, **fields) -> int:
        """Send a request without waiting; its id. A request over the broker's limit is refused
        here (the broker's ZeroMQ would drop it without a word)."""
        self._check_alive()
        rid = self._next_id
        data = protocol.pack({"op": op, "id": rid, "read": self._read_bytes, **fields})
        if len(data) > protocol.MAX_MESSAGE:
            raise InvalidRequest(
                f"{op}: this request would be {len(data)} bytes, over the limit of {protocol.MAX_MESSAGE} bytes "
                "a request may have; send less at once (shorter metadata, fewer names)")
        self._next_id += 1
        try:
            self._dealer.send(data)
        except zmq.Again as exc:
            raise BrokerGone(f"the broker took no request within {self.timeout:g} s") from exc
        except zmq.ZMQError as exc:
            raise BrokerGone(f"cannot send to the broker: {exc}") from exc
        self._told_read = self._read_bytes
        self._last_sent = rid
        return rid

    def send_frame(self, build: Callable[..., bytes], *args, ring: requests.Route | None = None) -> int:
        """A hand-off request as a frame on the control socket (``ipcpool.frames``: ``build(id,
        *args)`` makes it), without waiting; its id. Answered on the message channel as any request.
        ``ring``: (the session's request ring, the directory that says how long the broker
        busy-polls), where the frame goes instead while the broker reads it (``shm.requests``)."""
        if self._gone is not None or time.monotonic() - self._alive_at >= ALIVE_CHECK_S:
            self._check_alive()   # (only then: a call less on the hand-off's path)
        rid = self._next_id
        self._next_id = rid + 1
        data = build(rid, *args)
        if ring is not None and not self._on_socket:   # the ring, while the broker reads it a while yet
            writer, view = ring.writer, ring.view
            if view.awake_until() >= time.monotonic_ns() + requests.MARGIN_NS and writer.put(data):
                if view.awake_until() < time.monotonic_ns() + requests.MARGIN_NS:
                    self._send_control(frames.NUDGE_FRAME)   # its last look at the rings may have come first
                self.framed.add(rid)
                return rid
        self._send_control(data)
        self._on_socket = rid
        self.framed.add(rid)
        return rid

    def send_ready(self, frame: bytes, name_len_at: int, name: str, ring: requests.Route | None,
                   sealed: tuple = ()) -> int | None:
        """``send_frame`` for a frame built ahead with an empty name (a steady writer's:
        ``frames.completed``): its id and ``name`` added, and put in the ring in one C call where
        the package has it. Its id. ``sealed``: a seal's (event, stream, board, word, seq), its
        record and board post done first in that same call (``requests.put_sealed``); then None
        where nothing was done (no C part, no ring in use, the record failed: the caller seals
        the general way, which says why)."""
        put = requests.put_sealed if sealed else requests.put_ready
        if ring is None or self._on_socket or put is None:   # (no C part: as any frame)
            if sealed:
                return None
            return self.send_frame(frames.completed, frame, name_len_at, name, ring=ring)
        if self._gone is not None or time.monotonic() - self._alive_at >= ALIVE_CHECK_S:
            self._check_alive()
        rid = self._next_id
        got = put(*sealed, *ring.maps, frame, name_len_at, rid, name)
        if got < 0:   # (a seal whose record failed: nothing done)
            return None
        self._next_id = rid + 1
        if got == 2:
            self._send_control(frames.NUDGE_FRAME)   # its last look at the rings may have come first
        elif not got:
            self._send_control(frames.completed(rid, frame, name_len_at, name))
            self._on_socket = rid
        self.framed.add(rid)
        return rid

    def _send_control(self, data: bytes) -> None:
        try:
            try:
                self._control.send(data)   # the usual case: room in the socket (one datagram, whole)
            except BlockingIOError:   # the broker is behind: wait for room, up to the timeout
                self._control_io(socket.socket.send, select.POLLOUT, data)
        except TimeoutError:
            raise BrokerGone(f"the broker took no request within {self.timeout:g} s") from None
        except OSError as exc:
            raise BrokerGone(f"cannot send to the broker: {exc}") from exc

    def _check_alive(self) -> None:
        """Raise BrokerGone once the session is over: requests sent without waiting (a carve, a
        free) would otherwise "succeed" into a channel nobody answers. Looks at the control
        socket at most every ALIVE_CHECK_S (one poll)."""
        if self._gone is not None:
            raise BrokerGone(self._gone)
        now = time.monotonic()
        if now - self._alive_at < ALIVE_CHECK_S:
            return
        self._alive_at = now
        waiter = select.poll()
        waiter.register(self._control.fileno(), select.POLLIN)
        if waiter.poll(0):
            self._control_gone()

    def _control_gone(self):
        """The control socket is readable while nothing was asked on it: the broker ended the
        session (its last word, if any, says why) or went away. Raises BrokerGone."""
        why = "the broker went away (its control socket closed)"
        try:
            got = fdpass.recv(self._control)
        except (OSError, IpcPoolError):
            got = None
        if got is not None:
            close_all(got[1])
            if not got[0].get("ok") and got[0].get("error"):
                why = f"{why}: {str(got[0]['error'])[:protocol.MAX_ERROR]}"
        self._gone = why
        raise BrokerGone(why)

    def _ack(self) -> None:
        """Tell the broker what we took in (notices, while we ask nothing): a one-way request."""
        try:
            self._dealer.send(protocol.pack({"op": "ack", "id": 0, "read": self._read_bytes}), zmq.NOBLOCK)
            self._told_read = self._read_bytes
        except zmq.ZMQError:
            pass   # the next request carries it

    @trace.phase("call")
    def call(self, op: str, _wait: float | None = 0.0, **fields) -> dict:
        """A request and its reply. ``_wait`` is how long the broker may legitimately hold the
        reply back (a get waiting for a seal; None: without limit), on top of ``self.timeout``."""
        with self.lock:
            self.check_open()
            rid = self.send(op, **fields)
            if self.idle is not None:   # (the reply is on its way meanwhile)
                self.idle()
            spin = self.get_spin_s if _wait != 0.0 else self.spin_s
            if _wait is None:   # a wait without a limit says, once, what it waits for
                return self.wait_reply(rid, None, spin=spin, slow=SlowWait(describe(op, fields)))
            return self.wait_reply(rid, self.timeout + _wait, spin=spin)

    def wait_reply(self, rid: int, timeout: float | None, until=None, spin: float | None = None,
                   slow: SlowWait | None = None) -> dict | None:
        """The reply to ``rid``; or, with ``until``, None as soon as ``until()`` holds. ``slow``:
        logs once when the wait lasts (its sleeps are cut to log on time)."""
        if trace.hook is not None:
            trace.emit("client.wait", rid=rid)
        timeout_ms = -1 if timeout is None else int(timeout * 1000)
        spin_until = time.perf_counter() + (self.spin_s if spin is None else spin)
        while True:
            if until is not None and until():
                return None
            try:   # the common case: the reply is already there, no poll needed
                return self._take_reply(rid, self._dealer.recv(zmq.NOBLOCK))
            except zmq.Again:
                if time.perf_counter() < spin_until:   # a reply due soon: don't sleep for it yet
                    continue
            except _NotYet:
                continue
            if slow is not None and not slow.logged:
                events = dict(self._poller.poll(slow.poll_ms(timeout_ms)))
                slow.tick()
                if not events and not slow.logged:
                    continue
            else:
                events = dict(self._poller.poll(timeout_ms))
            if not events:
                if timeout is None:   # the line was due: sleep on
                    continue
                raise BrokerGone(f"the broker did not answer within {timeout:.0f} s")
            if self._dealer in events:
                continue
            if self._control.fileno() in events:
                # Nothing is sent on the control socket unasked: readable means EOF or an error.
                self._control_gone()

    def _take_reply(self, rid: int, data: bytes) -> dict:
        if trace.hook is not None:
            trace.emit("client.received", nbytes=len(data))
        self._read_bytes += len(data)
        if self._read_bytes - self._told_read > ACK_EVERY:
            self._ack()
        reply = protocol.unpack(data, protocol.MAX_REPLY)
        if trace.hook is not None:
            trace.emit("client.decoded", msg=reply)
        if "notify" not in reply and isinstance(reply.get("id"), int):
            if reply["id"] in self.framed:   # a frame's: says nothing of the message channel's
                self.framed.discard(reply["id"])
                if reply["id"] == self._on_socket:   # every frame sent on the socket was read
                    self._on_socket = 0
            else:
                self._last_answered = max(self._last_answered, reply["id"])
        if "notify" in reply:   # a notification, not a reply
            if self.on_notice(reply):
                raise _NotYet
            if reply["notify"] == "grown":
                self.on_grown(reply)
                raise _NotYet
            if reply["notify"] == "overflow":
                self._overflowed(reply.get("dropped"))
                raise _NotYet
            obj = WatchNotice.decode(reply).object
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                # One notice per session and seal: every watch of ours whose prefix matches takes it.
                for wid, prefix in self.watch_prefixes.items():
                    if obj["name"].startswith(prefix) and wid in self.watches:
                        self.watches[wid].append(obj)
            raise _NotYet
        self.on_progress()
        if self.on_reply(reply):   # a create, allocate or seal sent without waiting
            raise _NotYet
        if reply.get("id") == rid:
            if reply.get("ok"):
                return reply
            raise protocol.refusal(reply)
        if not reply.get("ok"):   # the error of an earlier one-way request
            err = protocol.refusal(reply)
            if isinstance(err, PeerRefused) and "session token" in str(err):
                # A broker that no longer knows us (restarted): every later request would say so.
                if self._gone is None:
                    log.error("the broker refused this session: %s", err)
                    self._gone = f"the broker no longer knows this session: {err}"
                raise BrokerGone(self._gone)
            self.refused(err)
        raise _NotYet

    def _overflowed(self, dropped: object) -> None:
        n = dropped if isinstance(dropped, int) and not isinstance(dropped, bool) else 1
        self.watch_dropped += n
        log.warning("the broker dropped %d seal notice(s) of this session's watches: it read them too slowly", n)

    def refused(self, err: IpcPoolError, *, unraised: bool = True) -> None:
        """A request sent without waiting was refused: recorded, and kept to be raised
        (``raise_unraised``) unless the caller raises it where it is (``unraised=False``)."""
        self.async_errors.append(err)
        if unraised:
            log.error("the broker refused a request sent without waiting: %s", err)
            self.unraised.append(err)

    def raise_unraised(self) -> None:
        """Raise the first refusal of a request sent without waiting that nobody raised yet."""
        if self.unraised:
            first = self.unraised.popleft()
            if self.unraised:
                first.add_note(f"the broker refused {len(self.unraised)} more request(s) sent without "
                               "waiting: see Client.async_errors")
            raise first

    def pump(self, timeout: float) -> None:
        """Sleep until the broker sends something (at most ``timeout`` s), and take it all in."""
        events = dict(self._poller.poll(int(timeout * 1000)))
        if self._control.fileno() in events and self._dealer not in events:
            self._control_gone()
        if self._dealer in events:
            self.drain()

    def drain(self) -> None:
        """Take in what arrived unasked (notifications, late errors) without waiting."""
        while True:
            try:
                self._take_reply(-1, self._dealer.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            except _NotYet:
                continue

    def next_watched(self, wid: int, timeout: float | None) -> dict | None:
        """The next seal announced to watch ``wid``, or None after ``timeout`` s."""
        queue = self.watches[wid]
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            while not queue:
                self.check_open()
                left = -1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
                events = dict(self._poller.poll(left))
                if self._control.fileno() in events and self._dealer not in events:
                    self._control_gone()
                if self._dealer in events:
                    try:
                        self._take_reply(-1, self._dealer.recv(zmq.NOBLOCK))
                    except (_NotYet, zmq.Again):
                        pass
                elif deadline is not None and time.monotonic() >= deadline:
                    return None
            return queue.popleft()

    def close(self) -> None:
        """Close both sockets (the session's bye, if any, was sent before)."""
        self.closed = True
        self._finalizer.detach()
        self._dealer.close()
        self._control.close()
