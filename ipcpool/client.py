"""What a worker imports: ``connect()``, ``Client.allocate``, ``Buffer``.

A client opens the control socket (hello -> session token), then a ZeroMQ DEALER whose routing id
is that token. Requests go over ZeroMQ; pool FDs come once per pool over the control socket. The
control socket also tells us the broker died: EOF there while we wait for a reply is BrokerGone.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import time
import warnings
import weakref
from typing import Any

import zmq

from . import fdpass, interop, paths, protocol
from .backend import client_backend
from .backend.base import ClientPool, Export
from .board import Board
from .buffer import Buffer, Subscription
from .errors import (
    BrokerGone,
    ClosedError,
    InvalidRequest,
    IpcPoolError,
    ObjectExists,
    PeerRefused,
    ProtocolError,
    error_from_wire,
)
from .growable import GrowableBuffer, Remap
from .handoff import Handoff, default_arena_bytes, env_us
from .handoff import export_of as _export
from .meta import wire_meta

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 30.0


class _NotYet(Exception):
    """A reply to an earlier request arrived first; keep waiting for ours."""


def connect(socket_dir: str | os.PathLike | None = None, *, timeout: float = DEFAULT_TIMEOUT,
            arena_bytes: int | None = None) -> Client:
    """Open a session with the broker serving ``socket_dir`` (default: see ``paths``).
    ``arena_bytes``: the size of the arenas small objects are carved from without a round trip
    (default ``IPCPOOL_ARENA_BYTES`` or 32 MiB; 0: every create waits for the broker).

    Spinning, read here from the environment: a reply is polled for ``IPCPOOL_CLIENT_SPIN_US``
    (300) before sleeping, a seal a ``get`` waits for ``IPCPOOL_GET_SPIN_US`` (1000), a pending
    seal event ``IPCPOOL_EVENT_SPIN_US`` (2000, CUDA) before a stream wait; waking a sleeping
    process costs tens of µs each time. ``IPCPOOL_CLIENT_SPIN_US=0`` turns the first two off."""
    return Client(socket_dir, timeout=timeout, arena_bytes=arena_bytes)


def _close_unclosed(pid: int, dealer: zmq.Socket, control: socket.socket) -> None:
    """A Client collected (or left at exit) without close(): end its session as close() would,
    by a bye the broker answers before the control socket closes, so the broker releases what the
    session held at once instead of waiting for this process to exit. Runs from weakref.finalize:
    never touches the Client itself. In a forked child (another pid) the session is not ours to
    end: nothing is sent."""
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
    except (zmq.ZMQError, IpcPoolError, OSError):
        pass   # a broker that is gone has nothing to release
    finally:
        if not dealer.closed:
            dealer.close(linger=0)
        control.close()
    warnings.warn("ipcpool.Client was not closed (its session was ended when it was collected); "
                  "use `with ipcpool.connect() as c:`", ResourceWarning, stacklevel=2)


_BYE_ID = (1 << 63) - 1   # a request id no Client._send reaches


class Client:
    def __init__(self, socket_dir: str | os.PathLike | None = None, *, timeout: float = DEFAULT_TIMEOUT,
                 arena_bytes: int | None = None):
        self.socket_dir = paths.resolve(socket_dir)
        self.timeout = timeout
        self.spin_s = env_us("IPCPOOL_CLIENT_SPIN_US", 300)
        self._lock = threading.RLock()
        self._closed = False
        self._next_id = 1
        self._pools: dict[str, ClientPool] = {}
        self._buffers: dict[int, Buffer] = {}
        self._watches: dict[int, collections.deque] = {}
        self._growables: dict[str, GrowableBuffer] = {}
        self._writing: set[str] = set()          # names of objects this client is writing
        self._tensor_bases: dict = {}            # torch views of whole slabs (interop), per dtype
        self.async_errors: list[IpcPoolError] = []
        self._handoff = Handoff(self, default_arena_bytes() if arena_bytes is None else max(0, int(arena_bytes)))
        self._control = self._open_control()
        try:
            hello = self._hello()
            self.session = hello["session"]
            self.backend_name = hello["backend"]
            self.pool_names = tuple(hello["pools"])
            self._backend = client_backend(self.backend_name)
            self._zctx = zmq.Context.instance()
            self._dealer = self._zctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.IDENTITY, hello["token"])
            self._dealer.setsockopt(zmq.LINGER, 1000)
            self._dealer.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_REPLY)
            self._dealer.connect(self._check_endpoint(hello["endpoint"]))
            self._poller = zmq.Poller()
            self._poller.register(self._dealer, zmq.POLLIN)
            self._poller.register(self._control.fileno(), zmq.POLLIN)
        except BaseException:
            self._control.close()
            raise
        self._finalizer = weakref.finalize(self, _close_unclosed, os.getpid(), self._dealer, self._control)

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
                raise PeerRefused(
                    f"permission denied on {path}: this user may not reach the broker; ask the "
                    "operator to add it to the broker's group"
                ) from exc
            except OSError as exc:
                sock.close()
                raise BrokerGone(f"cannot connect to the broker at {path}: {exc}") from exc

    def _control_call(self, msg: dict) -> tuple[dict, list[int]]:
        try:
            try:
                fdpass.send(self._control, msg)
            except (ConnectionError, BrokenPipeError):
                pass   # closed by the broker: the reply it sent first (why) may still be there to read
            got = fdpass.recv(self._control)
        except (socket.timeout, TimeoutError) as exc:
            raise BrokerGone(f"the broker did not answer within {self.timeout:.0f} s") from exc
        except (ConnectionError, BrokenPipeError) as exc:
            raise BrokerGone("the broker closed the connection") from exc
        if got is None:
            raise BrokerGone("the broker closed the connection")
        reply, fds = got
        if not reply.get("ok"):
            for fd in fds:
                os.close(fd)
            raise error_from_wire(reply.get("code", 1), str(reply.get("error", "unknown error")))
        return reply, fds

    @staticmethod
    def _check_endpoint(endpoint: str) -> str:
        # ZeroMQ retries a refused ipc connect silently; say it plainly instead of timing out later.
        path = endpoint.removeprefix("ipc://")
        if endpoint.startswith("ipc://") and not os.access(path, os.R_OK | os.W_OK):
            raise PeerRefused(
                f"permission denied on {path}: this user may not reach the broker's message "
                "channel; ask the operator to add it to the broker's group"
            )
        return endpoint

    def _hello(self) -> dict:
        reply, fds = self._control_call({"op": "hello", "version": protocol.PROTOCOL_VERSION, "pid": os.getpid()})
        for fd in fds:
            os.close(fd)
        for key, kind in (("token", bytes), ("session", int), ("backend", str), ("endpoint", str), ("pools", list)):
            if not isinstance(reply.get(key), kind):
                raise ProtocolError(f"hello reply lacks {key!r}")
        return reply

    @property
    def arena_bytes(self) -> int:
        return self._handoff.arena_bytes

    def _pool(self, name: str) -> ClientPool:
        pool = self._pools.get(name)
        if pool is None:
            reply, fds = self._control_call({"op": "pool_fd", "pool": name})
            if len(fds) != 2 or not isinstance(reply.get("info"), dict):
                for fd in fds:
                    os.close(fd)
                raise ProtocolError(f"pool {name!r}: expected its FD, its seal board's and its info, got {len(fds)} FD(s)")
            try:
                board = Board(fds[1], owner=False)
            except BaseException:
                os.close(fds[0])
                raise
            try:
                pool = self._pools[name] = self._backend.import_pool(reply["info"], fds[0])
            except BaseException:
                board.close()
                raise
            self._handoff.boards[name] = board
        return pool

    # -- requests -----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this ipcpool client is closed")

    def _send(self, op: str, **fields) -> int:
        rid = self._next_id
        self._next_id += 1
        try:
            self._dealer.send(protocol.pack({"op": op, "id": rid, **fields}))
        except zmq.ZMQError as exc:
            raise BrokerGone(f"cannot send to the broker: {exc}") from exc
        return rid

    def _call(self, op: str, _wait: float | None = 0.0, **fields) -> dict:
        """A request and its reply. ``_wait`` is how long the broker may legitimately hold the
        reply back (a get waiting for a seal; None: without limit), on top of ``self.timeout``."""
        with self._lock:
            self._check_open()
            rid = self._send(op, **fields)
            spin = self._handoff.get_spin_s if _wait != 0.0 else self.spin_s
            return self._wait_reply(rid, None if _wait is None else self.timeout + _wait, spin=spin)

    def _wait_reply(self, rid: int, timeout: float | None, until=None, spin: float | None = None) -> dict | None:
        """The reply to ``rid``; or, with ``until``, None as soon as ``until()`` holds."""
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
            events = dict(self._poller.poll(timeout_ms))
            if not events:
                raise BrokerGone(f"the broker did not answer within {timeout:.0f} s")
            if self._dealer in events:
                continue
            if self._control.fileno() in events:
                # Nothing is sent on the control socket unasked: readable means EOF or an error.
                raise BrokerGone("the broker went away (its control socket closed)")

    def _take_reply(self, rid: int, data: bytes) -> dict:
        reply = protocol.unpack(data, protocol.MAX_REPLY)
        if "notify" in reply:   # a notification, not a reply
            if self._handoff.on_notice(reply):
                raise _NotYet
            if reply["notify"] == "grown":
                g = self._growables.get(reply.get("growable"))
                if g is not None and isinstance(reply.get("gen"), int) and isinstance(reply.get("size"), int):
                    g._announce(reply["gen"], reply["size"])
                raise _NotYet
            queue = self._watches.get(reply.get("watch"))
            if queue is not None and isinstance(reply.get("object"), dict):
                queue.append(reply["object"])
            raise _NotYet
        self._backend.broker_progressed()
        if self._handoff.on_reply(reply):   # a create, allocate or seal sent without waiting
            raise _NotYet
        if reply.get("id") == rid:
            if reply.get("ok"):
                return reply
            raise error_from_wire(reply.get("code", 1), str(reply.get("error", "unknown error")))
        if not reply.get("ok"):   # the error of an earlier one-way request
            err = error_from_wire(reply.get("code", 1), str(reply.get("error")))
            log.error("broker rejected an earlier request: %s", err)
            self.async_errors.append(err)
        raise _NotYet

    def _pump(self, timeout: float) -> None:
        """Sleep until the broker sends something (at most ``timeout`` s), and take it all in."""
        events = dict(self._poller.poll(int(timeout * 1000)))
        if self._control.fileno() in events and self._dealer not in events:
            raise BrokerGone("the broker went away (its control socket closed)")
        if self._dealer in events:
            self._drain()

    def flush(self) -> None:
        """Wait until the broker has answered every request this client sent without waiting
        (carved creates and allocations, seals); raise the first it refused."""
        with self._lock:
            self._check_open()
            self._handoff.flush()

    def allocate(self, nbytes: int, *, pool: str = "default", stream: Any = None) -> Buffer:
        """Allocate ``nbytes`` from the broker's pool ``pool``; on CUDA, ``stream`` waits for it."""
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise InvalidRequest(f"nbytes must be a positive int, got {nbytes!r}")
        with self._lock:
            self._check_open()
            buf = self._handoff.carve("allocate", {"nbytes": nbytes, "pool": pool}, name=None)
            if buf is not None:   # carved from an arena, no round trip
                return buf
            reply = self._call("allocate", nbytes=nbytes, pool=pool)
            return self._adopt(reply, stream, owner=True)

    def open(self, token: bytes, *, stream: Any = None) -> Buffer:
        """Open an allocation another session shared with ``Buffer.share()``."""
        with self._lock:
            reply = self._call("open", token=bytes(token))
            return self._adopt(reply, stream, owner=False)

    def _adopt(self, reply: dict, stream: Any, owner: bool, *, name: str | None = None,
               readonly: bool = False) -> Buffer:
        memory = self._import(reply["alloc"], reply["pool"], _export(reply), stream)
        return self._keep(reply["alloc"], reply["pool"], memory, owner, name, reply.get("meta"), readonly)

    def _import(self, aid: int, pool: str, export: Export, stream: Any):
        """One allocation imported (a VMM-backed one from its chunk FDs); given back on failure."""
        try:
            fds = self._alloc_fds(aid, len(export.chunks)) if export.chunks else []
            return self._pool(pool).import_allocation(export, stream, fds)
        except BaseException:
            self._send("free", alloc=aid)   # give it back; nothing was imported
            raise

    def _keep(self, aid: int, pool: str, memory, owner: bool, name: str | None, meta: dict | None,
              readonly: bool) -> Buffer:
        buf = Buffer(self, aid, pool, memory, owner, name=name, meta=meta, readonly=readonly)
        self._buffers[id(buf)] = buf
        return buf

    # -- named objects --------------------------------------------------------------------------
    def create(self, name: str, nbytes: int, *, pool: str = "default", meta: dict | None = None,
               stream: Any = None) -> Buffer:
        """A new named object, writable by this client alone until ``Buffer.seal()``.

        An object of up to a quarter of an arena (``arena_bytes``) is carved from this client's
        arena without waiting for the broker: its refusal (a name another session uses, the
        objects quota) is then raised by ``seal()`` (or ``free()``), and nothing is lost. Larger
        objects wait for the broker, and a refusal is raised here."""
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise InvalidRequest(f"nbytes must be a positive int, got {nbytes!r}")
        fields = {"name": name, "nbytes": nbytes, "pool": pool}
        if meta:
            fields["meta"] = wire_meta(meta)
        with self._lock:
            self._check_open()
            if name in self._writing:
                raise ObjectExists(f"this client is already writing an object named {name!r}; seal or free it first")
            if nbytes <= self._handoff.arena_bytes // 4:   # what the broker would refuse, now
                protocol.check_object_name("name", name)
                if "meta" in fields:
                    protocol.check_meta("meta", fields["meta"])
            buf = self._handoff.carve("create", fields, name=name)
            if buf is None:
                reply = self._call("create", **fields)
                reply["meta"] = fields.get("meta", {})
                buf = self._adopt(reply, stream, owner=True, name=name)
            self._writing.add(name)
            return buf

    def _seal(self, buf: Buffer, stream: Any) -> None:
        with self._lock:
            self._check_open()
            self._buffers.pop(id(buf), None)
            self._writing.discard(buf.name)
            self._handoff.seal(buf, stream)

    def get(self, name: str, *, stream: Any = None, timeout: float | None = None) -> Buffer:
        """A read lease on object ``name``; on CUDA ``stream`` waits for the seal. Blocks until the
        object is sealed, or ``timeout`` seconds pass (WaitTimeout); ``timeout=0`` never waits."""
        fields: dict[str, Any] = {"name": name}
        if timeout is not None:
            fields["timeout_ms"] = max(0, int(timeout * 1000))
        with self._lock:
            reply = self._call("get", _wait=timeout, **fields)
            if not reply.get("pending"):
                return self._adopt(reply, stream, owner=False, name=name, readonly=True)
            # Answered before the seal: the memory now, the seal from the board (handoff).
            buf = self._adopt({**reply, "event": b""}, stream, owner=False, name=name, readonly=True)
            self._handoff.await_seal(buf, reply, stream, timeout)
            return buf

    def get_many(self, names: list[str], *, stream: Any = None) -> list[Buffer]:
        """Read leases on many sealed objects in one request (all or none; no waiting): how a
        restarted worker attaches to its weights."""
        names = list(names)
        out: list[Buffer] = []
        with self._lock:
            try:
                for start in range(0, len(names), protocol.MAX_BATCH):
                    batch = names[start : start + protocol.MAX_BATCH]
                    self._adopt_batch(self._call("get_many", names=batch), batch, stream, out)
            except BaseException:
                for buf in out:
                    buf.free(stream)
                raise
        return out

    def _adopt_batch(self, r: dict, names: list[str], stream: Any, out: list[Buffer]) -> None:
        """Import a batch of leases (columns, see ``batch_fields``) pool by pool: each pool's
        set-up and its one shared event once. VMM-backed ones are mapped from their own FDs."""
        n = len(names)
        if any(len(r.get(k, ())) != n for k in ("alloc", "pool", "size", "offset", "data", "sub", "chunks", "meta")):
            raise ProtocolError("get_many reply: columns do not match the names asked for")
        pools, events, datas = r["pools"], r["events"], r["datas"]
        by_pool: dict[int, list[int]] = {}
        for i in range(n):
            by_pool.setdefault(r["pool"][i], []).append(i)
        slots: list[Buffer | None] = [None] * n
        settled = [False] * n   # imported, or given back already
        try:
            for p, idx in by_pool.items():
                name, event = pools[p], events[p]
                exports = [Export(size=r["size"][i], offset=r["offset"][i], data=datas[r["data"][i]],
                                  ready_event=event, sub=r["sub"][i], chunks=tuple(r["chunks"][i])) for i in idx]
                plain = [(i, e) for i, e in zip(idx, exports) if not e.chunks]
                memories = self._pool(name).import_many([e for _, e in plain], stream) if plain else []
                for (i, _), memory in zip(plain, memories):
                    settled[i] = True
                    slots[i] = self._keep(r["alloc"][i], name, memory, False, names[i], r["meta"][i], True)
                for i, e in zip(idx, exports):
                    if e.chunks:   # mapped from its own chunk FDs
                        settled[i] = True   # _import gives it back itself if it fails
                        memory = self._import(r["alloc"][i], name, e, stream)
                        slots[i] = self._keep(r["alloc"][i], name, memory, False, names[i], r["meta"][i], True)
        except BaseException:
            for i in range(n):   # leases never imported go back now; the caller frees the rest
                if not settled[i]:
                    self._send("free", alloc=r["alloc"][i])
            raise
        finally:
            out.extend(b for b in slots if b is not None)

    def release(self, lease: Buffer, stream: Any = None) -> None:
        """Let go of a lease (the same as ``lease.release(stream)``)."""
        lease.free(stream)

    def delete(self, name: str) -> None:
        """Remove ``name``; its memory is freed once the last lease is released."""
        self._call("delete", name=name)

    def list(self, prefix: str = "") -> list[dict]:
        """Objects whose name starts with ``prefix``: name, size, pool, state, leases, meta."""
        return self._list(prefix, "objects")

    def _list(self, prefix: str, kind: str, after: str = "") -> list[dict]:
        """Every entry of ``kind`` under ``prefix`` after ``after``, a page per request."""
        out: list[dict] = []
        while True:
            reply = self._call("list", prefix=prefix, after=after, kind=kind)
            out += reply[kind]
            if not reply.get("more") or not isinstance(reply.get("after"), str) or reply["after"] <= after:
                return out
            after = reply["after"]

    def subscribe(self, prefix: str = "", *, existing: bool = False) -> Subscription:
        """Be told of each object sealed under ``prefix`` (and, with ``existing``, those sealed
        already), without polling the broker."""
        with self._lock:
            reply = self._call("watch", prefix=prefix, existing=existing)
            queue = self._watches[reply["watch"]] = collections.deque()
            listed = list(reply["existing"])
            if reply.get("more") and isinstance(reply.get("after"), str):
                # The rest page by page. Seals announced meanwhile are queued already: an object
                # listed here as well is kept once.
                listed += [o for o in self._list(prefix, "objects", reply["after"]) if o.get("state") == "sealed"]
                seen = {(o["name"], o.get("created")) for o in listed}
                announced = [o for o in queue if (o.get("name"), o.get("created")) not in seen]
                queue.clear()
                queue.extend(announced)
            queue.extendleft(reversed(listed))
            return Subscription(self, reply["watch"], prefix, queue)

    def _next_event(self, wid: int, timeout: float | None) -> dict | None:
        queue = self._watches[wid]
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while not queue:
                self._check_open()
                left = -1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
                events = dict(self._poller.poll(left))
                if self._control.fileno() in events and self._dealer not in events:
                    raise BrokerGone("the broker went away (its control socket closed)")
                if self._dealer in events:
                    try:
                        self._take_reply(-1, self._dealer.recv(zmq.NOBLOCK))
                    except (_NotYet, zmq.Again):
                        pass
                elif deadline is not None and time.monotonic() >= deadline:
                    return None
            return queue.popleft()

    def _unwatch(self, wid: int) -> None:
        if self._watches.pop(wid, None) is not None and not self._closed:
            self._call("unwatch", watch=wid)

    # -- tensors and arrays (torch, CuPy, numpy: imported only when used) -------------------------
    def put_tensor(self, name: str, tensor: Any, *, pool: str = "default", stream: Any = None,
                   user: dict | None = None) -> None:
        """Store a torch tensor, CuPy or numpy array as a new sealed object (dtype and shape kept)."""
        interop.put(self, name, tensor, pool=pool, stream=stream, user=user)

    def get_tensor(self, name: str, *, stream: Any = None, timeout: float | None = None) -> Any:
        """Object ``name`` as a torch tensor, zero-copy. The lease lasts until ``release_all(name)``
        or close."""
        return interop.get(self, name, "torch", stream=stream, timeout=timeout)

    def get_tensors(self, names: list[str], *, stream: Any = None) -> dict[str, Any]:
        """Many objects as torch tensors by name, with one request (``get_many``): how a
        restarted worker attaches to its weights. Leases last until ``release_all`` or close."""
        return interop.get_many(self, names, "torch", stream=stream)

    def get_arrays(self, names: list[str], *, stream: Any = None) -> dict[str, Any]:
        """Many objects as CuPy arrays (CUDA) or numpy arrays (host) by name, in one request."""
        return interop.get_many(self, names, self._backend.array_module, stream=stream)

    def get_array(self, name: str, *, stream: Any = None, timeout: float | None = None) -> Any:
        """Object ``name`` as a CuPy array (CUDA backend) or numpy array (host backend), zero-copy."""
        return interop.get(self, name, self._backend.array_module,
                           stream=stream, timeout=timeout)

    def release_all(self, name: str, stream: Any = None) -> int:
        """Release every lease this client holds on ``name``; returns how many."""
        leases = [b for b in self._buffers.values() if b.name == name and b.readonly]
        for b in leases:
            b.free(stream)
        return len(leases)

    def _free(self, buf: Buffer, stream: Any) -> None:
        with self._lock:
            self._buffers.pop(id(buf), None)
            if buf.owner and buf.name is not None:
                self._writing.discard(buf.name)
            if self._closed or self._handoff.free(buf, stream):   # carved: freed by where it lies
                return
            done = self._handoff.release(buf, stream)
            fields = {"alloc": buf.alloc_id}
            if done:
                fields["done_event"] = done
            self._send("free", **fields)

    # -- growable buffers -------------------------------------------------------------------------
    def create_growable(self, name: str, nbytes: int, *, pool: str = "default",
                        compression: bool = False) -> GrowableBuffer:
        """A new named buffer of at least ``nbytes`` on ``pool``'s device that can grow without
        copying (``GrowableBuffer.grow``). ``compression``: ask for compressible memory where the
        device offers it; ``GrowableBuffer.compression`` says what was obtained."""
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise InvalidRequest(f"nbytes must be a positive int, got {nbytes!r}")
        with self._lock:
            self._check_unattached(name)
            reply = self._call("grow_create", name=name, nbytes=nbytes, pool=pool, compression=bool(compression))
            return self._attach(reply)

    def attach_growable(self, name: str) -> GrowableBuffer:
        """Map an existing growable buffer; it follows every later grow (``GrowableBuffer.sync``)."""
        with self._lock:
            self._check_unattached(name)
            return self._attach(self._call("grow_attach", name=name))

    def grow(self, name: str, nbytes: int) -> Remap:
        """Grow the attached buffer ``name`` (the same as ``GrowableBuffer.grow``)."""
        g = self._growables.get(name)
        if g is None:
            raise InvalidRequest(f"this client is not attached to growable buffer {name!r}")
        return g.grow(nbytes)

    def list_growables(self, prefix: str = "") -> list[dict]:
        """Growable buffers: name, pool, size, chunks, attached sessions, state, generation."""
        return self._list(prefix, "growables")

    def delete_growable(self, name: str) -> None:
        """Delete a growable buffer; its memory goes once every attached client has closed it."""
        self._call("grow_delete", name=name)

    def _check_unattached(self, name: str) -> None:
        if name in self._growables:
            raise InvalidRequest(f"this client is already attached to growable buffer {name!r}")

    def _attach(self, reply: dict) -> GrowableBuffer:
        name = reply["name"]
        mapping = None
        try:
            mapping = self._backend.import_growable(reply["info"])
            g = GrowableBuffer(self, reply, mapping)
            g._map_to(reply["gen"], reply["size"], lambda first: self._chunk_fds(growable=name, first=first))
        except BaseException:
            if mapping is not None:
                mapping.close()   # what was mapped so far
            self._call("grow_detach", name=name)
            raise
        self._growables[name] = g
        return g

    def _grow(self, g: GrowableBuffer, nbytes: int) -> Remap:
        with self._lock:
            reply = self._call("grow", name=g.name, nbytes=nbytes)
            return g._map_to(reply["gen"], reply["size"], lambda first: self._chunk_fds(growable=g.name, first=first))

    def _sync_growable(self, g: GrowableBuffer) -> Remap:
        with self._lock:
            self._drain()
            gen, size = g._announced
            return g._map_to(gen, size, lambda first: self._chunk_fds(growable=g.name, first=first))

    def _detach_growable(self, g: GrowableBuffer) -> None:
        with self._lock:
            self._growables.pop(g.name, None)
            g._mapping.close()   # unmapped before the broker may release a chunk
            if not self._closed:
                self._call("grow_detach", name=g.name)

    def _drain(self) -> None:
        """Take in what arrived unasked (notifications, late errors) without waiting."""
        while True:
            try:
                self._take_reply(-1, self._dealer.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            except _NotYet:
                continue

    def _chunk_fds(self, first: int, **which) -> tuple[list[int], list[int]]:
        """One batch of chunk FDs over the control socket, of a growable buffer or a VMM-backed
        allocation, from chunk ``first``: (the sizes of the chunks they map, the FDs)."""
        reply, fds = self._control_call({"op": "chunk_fds", "first": first, **which})
        return list(reply.get("chunks", [])), fds

    def _alloc_fds(self, aid: int, count: int) -> list[int]:
        """All ``count`` chunk FDs of a VMM-backed allocation, batch by batch."""
        out: list[int] = []
        try:
            while len(out) < count:
                _, fds = self._chunk_fds(len(out), alloc=aid)
                if not fds:
                    raise ProtocolError(f"allocation {aid}: the broker sent no chunk FDs")
                out += fds
        except BaseException:
            for fd in out:
                os.close(fd)
            raise
        return out

    def share(self, buf: Buffer) -> bytes:
        with self._lock:
            self._handoff.settle(buf)
            return self._call("share", alloc=buf.alloc_id)["token"]

    def stats(self) -> dict:
        """Per-pool ``reserved``, ``used``, ``reserved_high``, ``used_high``; ``sessions``."""
        reply = self._call("stats")
        reply.pop("id"), reply.pop("ok")
        return reply

    def reset_high(self, pool: str | None = None) -> None:
        self._call("reset_high", **({"pool": pool} if pool else {}))

    def trim(self, pool: str, keep: int = 0) -> None:
        self._call("trim", pool=pool, keep=keep)

    def set_release_threshold(self, pool: str, nbytes: int) -> None:
        self._call("set_release_threshold", pool=pool, bytes=nbytes)

    @property
    def backend(self) -> str:
        return self.backend_name

    # -- closing ------------------------------------------------------------------------------
    def close(self) -> None:
        """Free what is still held (in order: our imports first), say bye, close. Idempotent."""
        with self._lock:
            if self._closed:
                return
            try:
                for buf in list(self._buffers.values()):
                    buf.free()
                for g in list(self._growables.values()):
                    g.close()
                self._call("bye")
            except IpcPoolError as exc:
                log.info("closing a session whose broker is gone: %s", exc)
            finally:
                self._closed = True
                self._finalizer.detach()
                self._dealer.close()
                self._control.close()
                self._tensor_bases.clear()   # (views of slabs: before the pools go)
                for pool in self._pools.values():
                    pool.close()
                self._pools.clear()
                for board in self._handoff.boards.values():
                    board.close()
                self._handoff.boards.clear()
                self._backend.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"session {self.session}"
        return f"<ipcpool.Client {self.backend_name} {self.socket_dir} {state}>"
