"""CUDA: stream-ordered IPC memory pools (POSIX FD), pointer export/import, IPC events.

Broker side: each configured pool is a cuda.core ``DeviceMemoryResource`` with IPC enabled (pinned
device memory on the configured device, POSIX-FD handle type), its release threshold, reuse
policies and peer access set through the driver. Every session gets its own stream per device
(R3): allocations are made on it, a fresh *ready* IPC event is recorded after each, and frees wait
on the client's *done* event on it before they free (R2). Nothing on these paths blocks the host.

Client side: a pool is imported once from its FD; each allocation is imported from its 64-byte
export data and the caller's stream waits on its ready event (R1). Releasing frees the import on
the caller's stream and records a fresh done event there for the broker to wait on.

Event lifetimes (R4) are in ``cuda_events``.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ..errors import (
    BackendUnavailable,
    ClosedError,
    InvalidRequest,
    IpcPoolError,
    OutOfMemory,
)
from ..protocol import HANDLE_BYTES
from .allocator import RangeAllocator
from .base import (
    REUSE_POLICIES,
    BrokerBackend,
    BrokerGrowable,
    BrokerPool,
    ClientBackend,
    ClientGrowable,
    ClientPool,
    Export,
    ImportedMemory,
    PoolSpec,
    PoolStats,
    SessionContext,
)
from .mps import mps_warnings

try:
    from cuda.core import (
        LEGACY_DEFAULT_STREAM,
        PER_THREAD_DEFAULT_STREAM,
        Buffer,
        Device,
        DeviceMemoryResource,
        DeviceMemoryResourceOptions,
        Stream,
    )
    from cuda.core._memory._ipc import IPCBufferDescriptor
    from cuda.core._utils.cuda_utils import CUDAError

    from . import cuda_driver as drv
    from . import cuda_vmm as vmm
    from .cuda_caps import capabilities
    from .cuda_events import Graveyard, UnrecordedEvent, open_ipc, record_into, record_ipc, wait_for
except ImportError as _exc:  # pragma: no cover - depends on the installation
    raise BackendUnavailable(f"the CUDA backend needs cuda-core and cuda-bindings: {_exc}") from _exc

__all__ = [
    "IMPORT_LIMIT",
    "CudaBrokerBackend",
    "CudaClientBackend",
    "CudaMemory",
    "capabilities",
]

log = logging.getLogger(__name__)

# The largest single pool allocation an importer may be handed. Importing a larger one kills the
# importer (SIGSEGV inside the pointer import, after the pool import succeeded; DESIGN.md).
# Measured 2026-11-22 on an NVIDIA H200, driver 580.159.04 (CUDA 13.0), cuda.core 1.2.0,
# cuda-bindings 13.3.1, with scripts/probe_import_limit.py (one child process per size, a fresh
# 8 GiB-max pool each): every size up to 5.125 GiB (5502926848 B) imported and was written end to
# end; 5.140625 GiB (5519704064 B) and above segfaulted (5.25, 5.5, 6 GiB too). The boundary is not
# 4 GiB there, but it is undocumented and may move with the driver, device or pool layout: keep a
# wide margin below the first failure. An allocation placed after a 3 GiB one failed at the same
# point (5.125 ok, 5.25 GiB not). Results: bench/results/import_limit_h200*_20261122.json.
IMPORT_LIMIT = 1 << 32
# Larger allocations and named objects are VMM chunks of at most this size (well under the limit).
VMM_CHUNK = 2 << 30
SLAB_SIZE = 1 << 30
SLAB_ALIGN = 512
MAX_CREDITS = 64   # events of ours a session may hold unused (see _CudaSession.issue_credit)

_tls = threading.local()


def _make_current(device_id: int) -> Device:
    """Make ``device_id``'s primary context current on this thread (cheap once done)."""
    current = getattr(_tls, "devices", None)
    if current is None:
        current = _tls.devices = {}
    dev = current.get(device_id)
    if dev is None or getattr(_tls, "last", None) != device_id:
        dev = Device(device_id)
        dev.set_current()
        current[device_id] = dev
        _tls.last = device_id
    return dev


class _SwitchContext:
    """Make a context current for one call, then give the caller back its own (a torch or cupy
    user on another device must not find its current device changed)."""

    __slots__ = ("prev",)

    def _target(self) -> Any:
        """The context to switch to, or None to stay in the current one."""
        raise NotImplementedError

    def __enter__(self) -> None:
        self.prev = drv.current_context()
        ctx = self._target()
        if ctx is not None and int(ctx) != int(self.prev):
            drv.restore_context(ctx)

    def __exit__(self, *exc: Any) -> None:
        if int(self.prev) != 0 and int(self.prev) != int(drv.current_context()):
            drv.restore_context(self.prev)


class _OnDevice(_SwitchContext):
    """Client side: the pool's device's primary context."""

    __slots__ = ("device",)
    # Each device's primary context, once retained. Device.set_current() retains it again on every
    # call (~0.4 ms measured on an H100); switching to a known context is one cheap driver call.
    _primary: dict[int, Any] = {}

    def __init__(self, device: int):
        self.device = device

    def _target(self) -> Any:
        ctx = self._primary.get(self.device)
        if ctx is None:
            Device(self.device).set_current()
            ctx = self._primary[self.device] = drv.current_context()
        return ctx


class _OnStream(_SwitchContext):
    """The context of ``stream``, for events recorded on or waited on by it: a caller's stream may
    belong to another device than the pool (peer access), and an event made in one context cannot
    be recorded on a stream of another."""

    __slots__ = ("stream",)

    def __init__(self, stream: Stream):
        self.stream = stream

    def _target(self) -> Any:
        handle = int(self.stream.handle)
        # the default streams (0-2) follow the current context
        return drv.stream_context(handle) if handle > 2 else None


def _translate(exc: Exception, what: str) -> IpcPoolError:
    text = str(exc)
    if "OUT_OF_MEMORY" in text:
        return OutOfMemory(f"{what}: {text}")
    return IpcPoolError(f"{what}: {text}")


def _check_device(device: int) -> None:
    count = drv.device_count()
    if not 0 <= device < count:
        raise BackendUnavailable(f"CUDA device {device} does not exist (this machine has {count})")


# --------------------------------------------------------------------------------------------
# Broker side


class _CudaSession(SessionContext):
    """One stream per device (allocations and ready events; R3), and the events retired on it."""

    def __init__(self, backend: CudaBrokerBackend):
        self._backend = backend
        self._streams: dict[int, Stream] = {}
        self.graveyard = Graveyard()
        self._handed: list[Any] = []
        # Events of ours the client may record instead of exporting its own (handle -> event): a
        # seal recorded on one is waited on by readers directly, one GPU hop from the writer.
        self.credits: dict[bytes, Any] = {}
        self.closed = False
        self.peer_dead = False

    def stream(self, device: int) -> Stream:
        if self.closed:
            raise ClosedError("session is closed")
        stream = self._streams.get(device)
        if stream is None:
            stream = _make_current(device).create_stream()
            self._streams[device] = stream
        return stream

    def streams(self) -> list[Stream]:
        return list(self._streams.values())

    def issue_credit(self, device: int) -> bytes:
        """A fresh IPC event of ours on ``device`` for the client to record (no peer has seen it
        before): it stays ours (alive as long as anyone may wait on it, R4), queried locally."""
        if self.closed or len(self.credits) >= MAX_CREDITS:
            return b""
        with _OnDevice(device):
            event = UnrecordedEvent()   # no GPU work of ours per credit (see the class)
        self.credits[event.ipc_handle] = event
        return event.ipc_handle

    def hand_out(self, event: Any) -> None:
        """An event named in a reply: alive until the client's next message (by then it has
        opened it and enqueued its wait), then retired like any other (R4)."""
        self._handed.append(event)

    def _retire_handed(self) -> None:
        if self._handed and self._streams:
            self.graveyard.bury(next(iter(self._streams.values())), *self._handed)
            self._handed = []

    def peer_progressed(self) -> None:
        self._retire_handed()
        self.graveyard.sweep()
        self._backend.sweep()

    def peer_gone(self) -> None:
        """The client's process has exited, so its GPU work is over: its done events, which may now
        never complete, no longer hold frees back."""
        self.peer_dead = True
        self._backend.sweep()

    def close(self) -> None:
        if self.closed:
            return
        self._retire_handed()
        self.closed = True
        for event in self.credits.values():   # never used: nobody waits on them
            event.close()
        self.credits.clear()
        self.graveyard.sweep()
        if len(self.graveyard):
            # Hand what is still pending to the backend; it sweeps it later. Never block here.
            self._backend.adopt(self.graveyard)
        self.graveyard = Graveyard()
        # Destroying a stream with work queued is fine: the work completes, then it is released.
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()
        self._backend.sweep()


class _DoneWait:
    """A client's done event, bound when its message is read: the session's stream waits on it
    right away (a wait binds to the record it follows; the client may destroy or reuse the event
    once the broker has read the message, and a query of an opened event whose exporter destroyed
    it, or died, never reports completion: R4), and a local marker recorded after that wait is
    polled without blocking. The free itself runs on the backend's stream once the marker is done,
    or once the client's process is gone: a stream that waits on a dead process's event never moves
    on (seen on an H200: still blocked 15 s after the kill), and nothing queued behind it would."""

    __slots__ = ("keep", "marker", "session", "stream")

    def __init__(self, handle: bytes, session: _CudaSession, device: int, keep: bool = False):
        self.session = session
        self.stream = None
        self.keep = False
        credit = session.credits.pop(handle, None)
        if credit is not None:
            # One of our events, recorded by the client: queried here, no wait enqueued. ``keep``:
            # readers wait on it too, so it lives on (in the allocation's events) after this.
            self.marker, self.keep = credit, keep
            return
        self.marker = None
        try:
            event = open_ipc(handle)
        except CUDAError as exc:
            # The client keeps its done events alive until the broker has read them, so this
            # means it is gone (and its work with it).
            log.warning("cannot open a done event (%s): the client is gone; not waiting for it", exc)
            return
        try:
            if event.is_done:   # R1/R2: the host sees it complete, so nothing waits on it (~1 µs)
                return
            if session.closed:  # a late message: wait on a stream of its own, never a shared one (R3)
                self.stream = stream = _make_current(device).create_stream()
            else:
                stream = session.stream(device)
            stream.wait(event)   # bound now, to the record the client made before its message (R4)
            self.marker = stream.record()
        finally:
            event.close()

    def settle(self) -> bool:
        """True (and the marker dropped) once nothing more needs waiting for. Never blocks."""
        if self.marker is not None and not (self.session.peer_dead or self.marker.is_done):
            return False
        if self.marker is not None:
            if not self.keep:
                self.marker.close()
            self.marker = None
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        return True


class _Slab:
    """One pool allocation that small allocations are carved from. Clients import it once and
    address its ranges by offset, so a small allocation costs the broker no driver call and the
    client no pointer import. A range goes back to the slab only once every importer's done event
    has completed (the same markers as a free: R2), so a range is idle on the GPU when it is handed
    out again and needs no ready event. Slabs live as long as their pool: a client's cached import
    must never outlive the memory it maps."""

    __slots__ = ("buffer", "data", "ranges")

    def __init__(self, buffer: Buffer, data: bytes, size: int):
        self.buffer = buffer
        self.data = data
        self.ranges = RangeAllocator(size, SLAB_ALIGN)


class _Allocation:
    __slots__ = ("buffer", "chunks", "extra", "freed", "offset", "on_idle", "parts", "ready", "seal_done", "sealed",
                 "size", "slab", "waits")

    def __init__(self, buffer: Buffer | None, size: int, ready: Any, slab: _Slab | None = None, offset: int = 0,
                 chunks: list[vmm.Chunk] | None = None):
        self.buffer = buffer
        self.chunks = chunks        # set for memory above the import limit (VMM chunks)
        self.slab = slab            # set for a range of a slab (buffer is then None)
        self.sealed: Any = None     # the seal event of a named object (also kept in ``extra``)
        self.seal_done = False      # ... and it has completed
        self.offset = offset
        self.size = size
        self.ready = ready          # the ready IPC event (None for a slab range): alive until the free has run (R4)
        self.extra: list[Any] = []  # ready/seal events recorded for other sessions, likewise
        self.waits: list[_DoneWait] = []  # importers' done events the free must follow (R2)
        self.freed = False
        self.on_idle: Callable[[], None] | None = None   # a range carved from an arena: its memory stays the arena's
        self.parts: dict[int, int] | None = None   # a shrunk arena: the slab ranges it still keeps


class CudaPool(BrokerPool):
    def __init__(self, backend: CudaBrokerBackend, spec: PoolSpec):
        self.spec = spec
        self._backend = backend
        self.device = spec.device
        unknown = set(spec.reuse) - set(REUSE_POLICIES)
        if unknown:
            raise InvalidRequest(f"pool {spec.name!r}: unknown reuse policies {sorted(unknown)}")
        _check_device(self.device)
        peers = sorted({p for p in spec.peer_access if p != self.device})
        for peer in peers:
            _check_device(peer)
            if not drv.can_access_peer(peer, self.device):
                raise BackendUnavailable(
                    f"pool {spec.name!r}: device {peer} cannot access memory on device {self.device} "
                    f"(cuDeviceCanAccessPeer says no); remove it from peer_access"
                )
        _make_current(self.device)
        try:
            self._mr = DeviceMemoryResource(
                self.device, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=spec.max_size)
            )
        except CUDAError as exc:
            raise _translate(exc, f"creating pool {spec.name!r} on device {self.device}") from exc
        try:  # roll back the pool if any property cannot be set
            self._pool = drv.pool_handle(self._mr)
            threshold = drv.UINT64_MAX if spec.release_threshold is None else spec.release_threshold
            drv.set_u64(self._pool, "release_threshold", threshold)
            for policy in REUSE_POLICIES:
                drv.set_reuse(self._pool, policy, spec.reuse.get(policy, True))
            if peers:
                drv.set_access(self._pool, peers)
            self._fd = int(self._mr.allocation_handle)
        except BaseException:
            self._mr.close()
            raise
        self._peers = peers
        self._closed = False
        # Slabs: a slab is at most 1 GiB (under the import limit) and at most an eighth of a
        # bounded pool; allocations up to a sixteenth of a slab are carved from slabs.
        bound = spec.max_size // 8 if spec.max_size else SLAB_SIZE
        self.slab_size = max(2 << 20, min(SLAB_SIZE, bound) // (2 << 20) * (2 << 20))
        self.slab_item_max = self.slab_size // 16
        self._slabs: list[_Slab] = []
        self._slab_used = 0
        self._used_high = 0
        self._vmm_bytes = 0   # VMM memory of allocations above the import limit

    # -- export
    @property
    def fd(self) -> int:
        if self._closed:
            raise ClosedError(f"pool {self.spec.name!r} is closed")
        return self._fd

    def pool_info(self) -> dict[str, Any]:
        return {
            "name": self.spec.name,
            "device": self.device,
            "max_size": self.spec.max_size,
            "peer_access": list(self._peers),
            "handle_type": "posix_fd",
            "vmm_above": IMPORT_LIMIT,   # larger allocations come as VMM chunks
            "slab_size": self.slab_size,
        }

    # -- allocation
    def allocate(self, nbytes: int, session: SessionContext) -> tuple[object, Export]:
        if self._closed:
            raise ClosedError(f"pool {self.spec.name!r} is closed")
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidRequest(f"allocation size must be a positive integer, got {nbytes!r}")
        sess = _as_session(session)
        self._backend.sweep()  # frees whose importers are done give their memory back first
        if nbytes > IMPORT_LIMIT:
            return self._allocate_vmm(nbytes)
        if nbytes <= self.slab_item_max:
            return self._carve(nbytes)
        stream = sess.stream(self.device)
        try:
            buf = self._mr.allocate(nbytes, stream=stream)
        except CUDAError as exc:
            raise _translate(exc, f"pool {self.spec.name!r} cannot allocate {nbytes} bytes") from exc
        try:
            data = bytes(buf.ipc_descriptor.__reduce__()[1][0])  # exported once, here
            ready, ready_handle = record_ipc(stream)
        except BaseException:
            buf.close(stream=stream)
            raise
        sess.graveyard.sweep()
        return _Allocation(buf, nbytes, ready), Export(size=nbytes, offset=0, data=data, ready_event=ready_handle)

    @property
    def arena_limit(self) -> int:
        return self.slab_item_max   # arenas are slab ranges, so carving one needs no driver call

    def carve(self, handle: object, export: Export, offset: int, nbytes: int,
              on_idle: Callable[[], None]) -> tuple[object, Export]:
        arena = _as_alloc(handle)
        if arena.slab is None or arena.freed:
            raise InvalidRequest("only a live slab range can be carved")
        alloc = _Allocation(None, nbytes, None, arena.slab, arena.offset + offset)
        alloc.on_idle = on_idle
        return alloc, Export(size=nbytes, offset=arena.offset + offset, data=arena.slab.data, sub=True)

    def _allocate_vmm(self, nbytes: int) -> tuple[object, Export]:
        """Memory a pool pointer import could not carry (see IMPORT_LIMIT): VMM chunks whose FDs
        the client maps into one range. cuMemCreate is synchronous: no ready event is needed."""
        if self.spec.max_size and self._vmm_bytes + nbytes > self.spec.max_size:
            raise OutOfMemory(f"pool {self.spec.name!r}: {nbytes} bytes more would pass its max_size")
        with _OnDevice(self.device):
            vmm.check_supported(self.device)
            sizes = vmm.split(nbytes, vmm.granularity(self.device), VMM_CHUNK)
            chunks = vmm.create_chunks(self.device, sizes, False)
        self._vmm_bytes += sum(sizes)
        export = Export(size=nbytes, chunks=tuple(sizes))
        return _Allocation(None, nbytes, None, chunks=chunks), export

    def chunk_fds(self, handle: object) -> list[int]:
        return [c.fd for c in _as_alloc(handle).chunks or ()]

    def restore(self, row: dict[str, Any], fds: list[int]) -> tuple[object, Export]:
        """A VMM-backed object a previous broker stored: its chunks, adopted from their FDs, are
        ours again (and freed like any). Pool memory is restored by ``AdoptedCudaPool`` instead."""
        sizes = [int(n) for n in row.get("chunks") or ()]
        if not sizes:
            for fd in fds:
                os.close(fd)
            raise InvalidRequest(f"pool {self.spec.name!r} restores VMM chunks only")
        with _OnDevice(self.device):
            chunks = vmm.adopt_chunks(fds, sizes)
        self._vmm_bytes += sum(sizes)
        return _Allocation(None, row["size"], None, chunks=chunks), Export(size=row["size"], chunks=tuple(sizes))

    def _carve(self, nbytes: int) -> tuple[object, Export]:
        for slab in self._slabs:
            try:
                offset = slab.ranges.allocate(nbytes)
                break
            except OutOfMemory:
                continue
        else:
            slab = self._new_slab()
            offset = slab.ranges.allocate(nbytes)
        self._slab_used += slab.ranges.rounded(nbytes)
        self._used_high = max(self._used_high, self._used())
        export = Export(size=nbytes, offset=offset, data=slab.data, sub=True)
        return _Allocation(None, nbytes, None, slab, offset), export

    def _new_slab(self) -> _Slab:
        stream = self._backend.reaper(self.device)
        try:
            buf = self._mr.allocate(self.slab_size, stream=stream)
        except CUDAError as exc:
            raise _translate(exc, f"pool {self.spec.name!r} cannot reserve a {self.slab_size}-byte slab") from exc
        stream.sync()   # rare (once per slab): afterwards no range of it ever needs a ready event
        slab = _Slab(buf, bytes(buf.ipc_descriptor.__reduce__()[1][0]), self.slab_size)
        self._slabs.append(slab)
        return slab

    def _used(self) -> int:
        """Bytes handed out: the driver's count, with each slab counted by its ranges in use."""
        slabs = len(self._slabs) * self.slab_size
        return drv.get_u64(self._pool, "used") - slabs + self._slab_used + self._vmm_bytes

    def reexport(self, handle: object, export: Export, session: SessionContext) -> Export:
        """Another session opens this allocation: its stream follows the allocation (the first
        ready event, a local wait here), then a fresh ready event is recorded there for it."""
        alloc = _as_alloc(handle)
        if alloc.freed:
            raise InvalidRequest("allocation was freed")
        if alloc.slab is not None or alloc.chunks is not None:
            return export   # idle on the GPU when handed out (a slab range; new VMM chunks)
        stream = _as_session(session).stream(self.device)
        stream.wait(alloc.ready)
        event, ready_handle = record_ipc(stream)
        alloc.extra.append(event)  # alive until the free has run, like the first ready event
        return Export(size=export.size, offset=export.offset, data=export.data, ready_event=ready_handle)

    def add_release(self, handle: object, session: SessionContext, done_event: bytes) -> None:
        alloc = _as_alloc(handle)
        if done_event:
            alloc.waits.append(_DoneWait(done_event, _as_session(session), self.device))  # now (R4)
        self._backend.sweep()

    def seal(self, handle: object, session: SessionContext, done_event: bytes) -> bytes:
        """The writer is done at ``done_event``: the free follows it, and readers get a broker event
        recorded once, after a wait on it on the writer's session stream (its own stream: R3)."""
        alloc = _as_alloc(handle)
        sess = _as_session(session)
        credit = sess.credits.get(done_event) if done_event else None
        if credit is not None and alloc.ready is None:
            # Recorded by the writer on one of our events: readers wait on that very event (one
            # GPU hop), and so does the free. Kept until the free has run, like any seal event.
            alloc.waits.append(_DoneWait(done_event, sess, self.device, keep=True))
            alloc.extra.append(credit)
            alloc.sealed = credit
            self._backend.unconfirmed.append(alloc)
            return done_event
        stream = sess.stream(self.device)
        if alloc.ready is not None:
            stream.wait(alloc.ready)
        if credit is not None:
            wait_for(stream, credit)   # our own event: a local wait (the _DoneWait below only queries it)
        if done_event:
            alloc.waits.append(_DoneWait(done_event, sess, self.device))  # the wait, on stream
        event, sealed = record_ipc(stream)
        alloc.extra.append(event)
        alloc.sealed = event
        self._backend.unconfirmed.append(alloc)   # its completion is noted later, off any request
        return sealed

    def credit(self, session: SessionContext) -> bytes:
        return _as_session(session).issue_credit(self.device)

    def check_promise(self, session: SessionContext, handle: bytes) -> None:
        if handle not in _as_session(session).credits:
            raise InvalidRequest("create: seal_credit is not an unused credit of this session")

    def seal_done(self, handle: object) -> bool:
        alloc = _as_alloc(handle)
        if not alloc.seal_done and alloc.sealed is not None and not alloc.freed and alloc.sealed.is_done:
            alloc.seal_done = True   # one query (~1 µs); then never again
        return alloc.seal_done or alloc.sealed is None

    def shrink(self, handle: object, keep: list[tuple[int, int]]) -> int:
        alloc = _as_alloc(handle)
        if alloc.slab is None or alloc.freed or alloc.on_idle is not None or alloc.parts is not None:
            return 0
        ranges = alloc.slab.ranges
        given = ranges.free(alloc.offset)
        alloc.parts = {alloc.offset + off: ranges.reserve(alloc.offset + off, size) for off, size in keep}
        given -= sum(alloc.parts.values())
        self._slab_used -= given
        return given

    def free_part(self, handle: object, offset: int) -> None:
        alloc = _as_alloc(handle)
        size = alloc.parts.pop(alloc.offset + offset, None) if alloc.parts else None
        if size is not None:   # idle: every importer's done event completed (R2)
            alloc.slab.ranges.free(alloc.offset + offset)
            self._slab_used -= size

    def join_seals(self, handles: list[object], session: SessionContext) -> bytes:
        sess = _as_session(session)
        stream = sess.stream(self.device)
        for handle in handles:
            alloc = _as_alloc(handle)
            if alloc.sealed is not None and not alloc.seal_done:
                if alloc.sealed.is_done:
                    alloc.seal_done = True      # never waited on again (a thousand-object attach)
                else:
                    wait_for(stream, alloc.sealed)   # our own events: a local wait, nothing to open
        event, joined = record_ipc(stream)
        sess.hand_out(event)
        return joined

    def free(self, handle: object, session: SessionContext, done_event: bytes = b"") -> None:
        """R2 without host synchronisation: the session's stream waits on the done event now, and
        the memory is freed on the backend's own stream once the marker after that wait (and after
        every ``add_release`` wait) has completed, as seen by polling at each later call into the
        backend, or once the client's process is gone (``peer_gone``). See ``_DoneWait``."""
        alloc = _as_alloc(handle)
        if alloc.freed:
            raise InvalidRequest("allocation freed twice")
        alloc.freed = True
        if done_event:
            alloc.waits.append(_DoneWait(done_event, _as_session(session), self.device))
        self._backend.defer_free(self, alloc)

    def _free_now(self, alloc: _Allocation) -> None:
        """Every importer is done: free on the backend's stream, after the allocation itself."""
        stream = self._backend.reaper(self.device)
        if alloc.slab is not None:   # every importer's done marker completed: the range is idle
            if alloc.on_idle is not None:
                alloc.on_idle()      # back to its arena (the arena's own range stays taken)
            elif alloc.parts is not None:   # a shrunk arena: what it still keeps
                for offset, size in alloc.parts.items():
                    alloc.slab.ranges.free(offset)
                    self._slab_used -= size
                alloc.parts = {}
            else:
                alloc.slab.ranges.free(alloc.offset)
                self._slab_used -= alloc.slab.ranges.rounded(alloc.size)
            if alloc.extra:
                self._backend.graveyard.bury(stream, *alloc.extra)
            alloc.extra = []
            return
        if alloc.chunks is not None:   # every importer has unmapped (after its work) or is gone
            with _OnDevice(self.device):
                for chunk in alloc.chunks:
                    chunk.close()
            self._vmm_bytes -= sum(c.size for c in alloc.chunks)
            alloc.chunks = []
            self._backend.graveyard.bury(stream, *alloc.extra)
            alloc.extra = []
            return
        stream.wait(alloc.ready)  # (no wait on alloc.extra: a seal event may never complete)
        alloc.buffer.close(stream=stream)
        self._backend.graveyard.bury(stream, alloc.ready, *alloc.extra)
        alloc.extra = []

    # -- statistics and policy
    def stats(self) -> PoolStats:
        self._backend.sweep()
        p = self._pool
        used = self._used()
        self._used_high = max(self._used_high, used)
        return PoolStats(
            reserved=drv.get_u64(p, "reserved") + self._vmm_bytes,
            used=used,
            reserved_high=drv.get_u64(p, "reserved_high"),
            used_high=self._used_high,   # ours: the driver's counts whole slabs
        )

    def reuse_policies(self) -> dict[str, bool]:
        return {policy: drv.get_reuse(self._pool, policy) for policy in REUSE_POLICIES}

    def release_threshold(self) -> int:
        return drv.get_u64(self._pool, "release_threshold")

    def reset_high(self) -> None:
        drv.set_u64(self._pool, "reserved_high", 0)
        drv.set_u64(self._pool, "used_high", 0)
        self._used_high = self._used()

    def trim(self, keep: int) -> None:
        # Let the driver learn which stream-ordered frees have completed (non-blocking), then trim.
        # Memory that an importer still has mapped is not released (seen on an H200, driver
        # 580.159: nothing while a client kept the pool imported, everything once they had left).
        self._backend.query_streams()
        drv.trim_to(self._pool, max(0, int(keep)))

    def set_release_threshold(self, nbytes: int) -> None:
        drv.set_u64(self._pool, "release_threshold", int(nbytes))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for slab in self._slabs:
            slab.buffer.close(stream=self._backend.reaper(self.device))
        self._slabs.clear()
        self._mr.close()  # also closes the exported FD; memory still in use is released later


class CudaGrowable(BrokerGrowable):
    """A growable buffer's VMM chunks on one device (see ``cuda_vmm``)."""

    def __init__(self, device: int, compression: bool, chunks: list[vmm.Chunk] | None = None):
        self.device = device
        with _OnDevice(device):
            vmm.check_supported(device)
            # Compression only where the device offers it; what each chunk got is read back.
            self.compression = compression and vmm.compression_supported(device)
            self.gran = vmm.granularity(device, self.compression)
        self._chunks: list[vmm.Chunk] = chunks or []

    @property
    def chunks(self) -> list[int]:
        return [c.size for c in self._chunks]

    def info(self) -> dict[str, Any]:
        got = bool(self._chunks) and all(c.compression for c in self._chunks)
        return {"device": self.device, "granularity": self.gran, "compression": got}

    def grow(self, nbytes: int) -> None:
        if nbytes <= self.size:
            return
        with _OnDevice(self.device):
            sizes = vmm.split(nbytes - self.size, self.gran, VMM_CHUNK)
            self._chunks += vmm.create_chunks(self.device, sizes, self.compression)

    def fds(self, first: int) -> list[int]:
        return [c.fd for c in self._chunks[first:]]

    def close(self) -> None:
        with _OnDevice(self.device):
            for c in self._chunks:
                c.close()
        self._chunks = []


class AdoptedCudaPool(BrokerPool):
    """A pool a previous broker exported, kept from systemd's FD store: the memory of the objects
    restored in it lives on (the FD alone keeps it), clients import it as before, but an imported
    pool cannot allocate (CUDA_ERROR_INVALID_VALUE, seen on an H200), so it is read-only. Its
    memory goes back to the device once the broker and every client have let go of the pool."""

    read_only = True

    def __init__(self, spec: PoolSpec, fd: int, info: dict[str, Any]):
        self.spec = spec
        self._fd = fd
        os.set_inheritable(fd, False)
        self.slab_size = int(info.get("slab_size") or 0)
        self._used = 0
        self._high = 0

    @property
    def fd(self) -> int:
        if self._fd < 0:
            raise ClosedError(f"pool {self.spec.name!r} is closed")
        return self._fd

    def pool_info(self) -> dict[str, Any]:
        return {"name": self.spec.name, "device": self.spec.device, "max_size": 0, "peer_access": [],
                "handle_type": "posix_fd", "slab_size": self.slab_size, "read_only": True}

    def allocate(self, nbytes: int, session: SessionContext) -> tuple[object, Export]:
        raise InvalidRequest(f"pool {self.spec.name!r} holds objects restored after a broker restart; "
                             "it cannot allocate (use the configured pool)")

    def restore(self, row: dict[str, Any], fds: list[int]) -> tuple[object, Export]:
        for fd in fds:
            os.close(fd)
        data = bytes(row["data"])
        if len(data) != HANDLE_BYTES or (row.get("sub") and not self.slab_size):
            raise InvalidRequest(f"pool {self.spec.name!r}: a stored object lacks its export data")
        self._used += row["size"]
        self._high = max(self._high, self._used)
        # No ready event: the writer's work ended before the old broker sealed the object.
        return row["size"], Export(size=row["size"], offset=row["offset"], data=data, sub=bool(row.get("sub")))

    def free(self, handle: object, session: SessionContext, done_event: bytes = b"") -> None:
        self._used -= int(handle)   # the memory itself goes with the pool (see the class doc)

    def stats(self) -> PoolStats:
        return PoolStats(reserved=self._used, used=self._used, reserved_high=self._high, used_high=self._high)

    def reset_high(self) -> None:
        self._high = self._used

    def trim(self, keep: int) -> None:
        pass   # nothing is free in it: its memory is released with the pool

    def set_release_threshold(self, nbytes: int) -> None:
        raise InvalidRequest(f"pool {self.spec.name!r} is read-only")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _as_session(session: SessionContext) -> _CudaSession:
    if not isinstance(session, _CudaSession):
        raise InvalidRequest(f"not a CUDA session: {type(session).__name__}")
    return session


def _as_alloc(handle: object) -> _Allocation:
    if not isinstance(handle, _Allocation):
        raise InvalidRequest(f"not a CUDA allocation: {type(handle).__name__}")
    return handle


class CudaBrokerBackend(BrokerBackend):
    name = "cuda"
    durable = True

    def startup_warnings(self) -> list[str]:
        return mps_warnings()   # under MPS a crash is not isolated to its process

    def __init__(self) -> None:
        try:
            _make_current(0)
        except (CUDAError, RuntimeError, OSError) as exc:
            raise BackendUnavailable(f"CUDA is not usable here: {exc}") from exc
        self._reapers: dict[int, Stream] = {}
        self.graveyard = Graveyard()
        self._orphans: list[Graveyard] = []
        self._sessions: weakref.WeakSet[_CudaSession] = weakref.WeakSet()
        self._pools: list[CudaPool] = []
        self._pending: list[tuple[CudaPool, _Allocation]] = []  # frees waiting on done events
        self.unconfirmed: collections.deque[_Allocation] = collections.deque()  # seals not seen done

    def create_pool(self, spec: PoolSpec) -> BrokerPool:
        pool = CudaPool(self, spec)
        self._pools.append(pool)
        return pool

    def adopt_pool(self, spec: PoolSpec, fd: int, info: dict[str, Any]) -> BrokerPool:
        return AdoptedCudaPool(spec, fd, info)

    def create_growable(self, spec: PoolSpec, nbytes: int, compression: bool) -> BrokerGrowable:
        g = CudaGrowable(spec.device, compression)
        g.grow(nbytes)
        return g

    def adopt_growable(self, spec: PoolSpec, info: dict[str, Any], chunks: list[int], fds: list[int]) -> BrokerGrowable:
        with _OnDevice(spec.device):
            adopted = vmm.adopt_chunks(fds, chunks)
        return CudaGrowable(spec.device, bool(info.get("compression")), adopted)

    def open_session(self) -> SessionContext:
        session = _CudaSession(self)
        self._sessions.add(session)
        return session

    def reaper(self, device: int) -> Stream:
        """The backend's own stream on ``device``: frees run here; it never waits on a client."""
        stream = self._reapers.get(device)
        if stream is None:
            stream = self._reapers[device] = _make_current(device).create_stream()
        return stream

    def adopt(self, graveyard: Graveyard) -> None:
        self._orphans.append(graveyard)

    def defer_free(self, pool: CudaPool, alloc: _Allocation) -> None:
        self._pending.append((pool, alloc))
        self.sweep()

    @property
    def pending_frees(self) -> int:
        return len(self._pending)

    def sweep(self) -> None:
        """Never blocks: run the frees whose importers are done; drop events nobody needs."""
        if self._pending:
            waiting = []
            for pool, alloc in self._pending:
                alloc.waits = [w for w in alloc.waits if not w.settle()]
                if alloc.waits:
                    waiting.append((pool, alloc))
                else:
                    pool._free_now(alloc)
            self._pending = waiting
        self.graveyard.sweep()
        if self._orphans:
            for g in self._orphans:
                g.sweep()
            self._orphans = [g for g in self._orphans if len(g)]
        self._confirm_seals()

    def _confirm_seals(self, most: int = 64) -> None:
        """Note seal events that have completed (a few queries per call, oldest first), so a
        batch attach need not wait on, or even query, a thousand long-finished seals."""
        for _ in range(min(most, len(self.unconfirmed))):
            alloc = self.unconfirmed[0]
            if alloc.sealed is not None and not alloc.freed and not alloc.sealed.is_done:
                return   # seals complete in order on a stream; later ones likely pending too
            self.unconfirmed.popleft()
            alloc.seal_done = alloc.sealed is not None

    def query_streams(self) -> None:
        for session in list(self._sessions):
            for stream in session.streams():
                drv.query_stream(stream)
        for stream in self._reapers.values():
            drv.query_stream(stream)
        self.sweep()

    def close(self) -> None:
        # Every pool is closed by now; what remains is bookkeeping. Never wait on a client here.
        self.sweep()
        for pool, _alloc in self._pending:
            log.warning("pool %r: a free still waits on a client at shutdown", pool.spec.name)
        for stream in self._reapers.values():
            stream.sync()
        self.graveyard.drain()
        for stream in self._reapers.values():
            stream.close()
        self._reapers.clear()


# --------------------------------------------------------------------------------------------
# Client side


class CudaMemory(ImportedMemory):
    """One imported allocation: a cuda.core Buffer over the broker's memory (zero-copy). For a slab
    range the Buffer is made on first use: a batch of a thousand leases mostly needs only ``ptr``."""

    def __init__(self, buffer: Buffer | None, size: int, device: int, whole: bool = True,
                 mapping: vmm.Mapping | None = None, base: tuple[CudaMemory, int] | None = None):
        self._buffer = buffer
        self._released = False
        self.size = size
        self.device = device
        self.whole = whole   # False: a range of a slab the pool keeps imported
        self.mapping = mapping   # VMM chunks mapped here (memory above the import limit)
        self._slab = base        # a slab range: (the slab, as memory of its own; our offset in it)
        self._ptr = int(buffer.handle) if buffer is not None else base[0].ptr + base[1]

    @property
    def ptr(self) -> int:
        return self._ptr

    def slab(self) -> tuple[CudaMemory, int] | None:
        return self._slab

    @property
    def buffer(self) -> Buffer:
        self._live()
        if self._buffer is None:
            self._buffer = Buffer.from_handle(self._ptr, self.size, owner=self._slab[0].buffer)
        return self._buffer

    @property
    def released(self) -> bool:
        return self._released

    def _live(self) -> None:
        if self._released:
            raise ClosedError("memory was released")

    @property
    def cuda_array_interface(self) -> dict[str, Any]:
        self._live()
        # "stream": None: the stream given at import already waits on the ready event (R1); work
        # on other streams is ordered by the caller, as for any CUDA allocation.
        return {
            "version": 3,
            "shape": (self.size,),
            "typestr": "|u1",
            "data": (self._ptr, False),
            "strides": None,
            "stream": None,
        }

    def dlpack(self, **kwargs: Any) -> Any:
        # Ordering is already in place: the stream given at import waits on the ready/seal event
        # (R1), so the export asks cuda.core for no further synchronisation (-1).
        kwargs["stream"] = -1
        try:
            return self.buffer.__dlpack__(**kwargs)
        except (NotImplementedError, BufferError, ValueError, TypeError) as exc:
            log.debug("Buffer.__dlpack__ refused stream=-1 (%s); exporting without a stream", exc)
            kwargs.pop("stream")
            return self.buffer.__dlpack__(**kwargs)

    def dlpack_device(self) -> tuple[int, int]:
        self._live()
        return (2, self.device)   # kDLCUDA: known, so no pointer query (~20 µs measured) per call

    def copy_from_host(self, src: memoryview, offset: int, backend: CudaClientBackend, stream: Any) -> None:
        """Host bytes into this memory at ``offset``, ordered on ``stream`` (``Buffer.write``)."""
        self._live()
        with _OnDevice(self.device):
            s = backend.stream(stream, self.device)
            try:
                drv.copy_from_host(self._ptr + offset, src, int(s.handle))
            except IpcPoolError:
                raise
            except CUDAError as exc:
                raise _translate(exc, "copying host bytes to the GPU") from exc

    def _take(self) -> Buffer | None:
        if self._released:
            raise ClosedError("memory was already released")
        self._released = True
        buf, self._buffer = self._buffer, None
        return buf


def _order_after(stream: Stream, handle: bytes, spin_s: float) -> None:
    """R1 on the host first: a stream wait on another process's IPC event costs ~270 µs on the GPU
    even when the event has completed (H100, driver 580), a query ~1 µs. So query; while pending,
    spin up to ``spin_s``; only then let ``stream`` wait, so correctness never depends on timing.
    The event is opened in the stream's context (a caller's stream may be on a peer device)."""
    with _OnStream(stream):
        event = open_ipc(handle)
        try:
            if event.is_done:
                return
            until = time.perf_counter() + spin_s
            while time.perf_counter() < until:
                if event.is_done:
                    return
            stream.wait(event)   # bound now, to the latest record (R4)
        finally:
            event.close()


class CudaClientPool(ClientPool):
    seal_event = True

    def __init__(self, backend: CudaClientBackend, info: dict[str, Any], fd: int):
        self._backend = backend
        try:
            self.name = str(info.get("name", "?"))
            self.device = int(info["device"])
            peers = [int(p) for p in info.get("peer_access", ())]
            _check_device(self.device)
            try:
                with _OnDevice(self.device):
                    self._mr = DeviceMemoryResource.from_allocation_handle(self.device, fd)
            except CUDAError as exc:
                raise BackendUnavailable(f"cannot import pool {self.name!r}: {exc}") from exc
        finally:
            os.close(fd)  # the imported pool holds its own reference
        try:
            # Access is per process: an importer on another device must grant itself access on its
            # imported pool, or copies fail (DESIGN.md). Grant every listed peer present here.
            count = drv.device_count()
            local_peers = [p for p in peers if p != self.device and p < count]
            if local_peers:
                drv.set_access(drv.pool_handle(self._mr), local_peers)
        except BaseException:
            self._mr.close()
            raise
        self.slab_size = int(info.get("slab_size", 0))
        self._slabs: dict[bytes, CudaMemory] = {}
        self._closed = False

    def import_allocation(self, export: Export, stream: Any = None, fds: list[int] = ()) -> ImportedMemory:
        if self._closed:
            for fd in fds:
                os.close(fd)
            raise ClosedError(f"pool {self.name!r} is closed")
        if export.chunks:
            return self._map_chunks(export, stream, list(fds))
        if export.sub and not export.ready_event and export.data in self._slabs:
            # A range of a slab imported already, nothing to wait for: no driver call at all.
            if export.offset + export.size > self.slab_size:
                raise InvalidRequest("a slab range lies outside its slab")
            return self._range(export)
        if len(export.data) != HANDLE_BYTES:
            raise InvalidRequest(f"pointer export data is {HANDLE_BYTES} bytes, got {len(export.data)}")
        try:
            with _OnDevice(self.device):
                s = self._backend.stream(stream, self.device)
                if export.ready_event:   # R1: before any use of the memory on s
                    _order_after(s, export.ready_event, self._backend.event_spin_s)
                if export.sub:
                    if export.offset + export.size > self.slab_size:
                        raise InvalidRequest("a slab range lies outside its slab")
                    return self._range(export)
                buf = Buffer.from_ipc_descriptor(
                    self._mr, IPCBufferDescriptor._init(bytes(export.data), export.size), stream=s
                )
        except CUDAError as exc:
            raise _translate(exc, f"importing {export.size} bytes from pool {self.name!r}") from exc
        return CudaMemory(buf, export.size, self.device)

    def import_many(self, exports: list[Export], stream: Any = None) -> list[ImportedMemory]:
        if self._closed:
            raise ClosedError(f"pool {self.name!r} is closed")
        out: list[ImportedMemory] = []
        try:
            with _OnDevice(self.device):
                s = self._backend.stream(stream, self.device)
                for handle in dict.fromkeys(e.ready_event for e in exports if e.ready_event):
                    _order_after(s, handle, self._backend.event_spin_s)   # R1, once per distinct event
                for e in exports:
                    if len(e.data) != HANDLE_BYTES:
                        raise InvalidRequest(f"pointer export data is {HANDLE_BYTES} bytes, got {len(e.data)}")
                    if e.sub:
                        if e.offset + e.size > self.slab_size:
                            raise InvalidRequest("a slab range lies outside its slab")
                        out.append(self._range(e))
                    else:
                        desc = IPCBufferDescriptor._init(bytes(e.data), e.size)
                        out.append(CudaMemory(Buffer.from_ipc_descriptor(self._mr, desc, stream=s), e.size, self.device))
        except CUDAError as exc:
            for mem in out:   # nothing half-imported stays behind
                self.release(mem, stream)
            raise _translate(exc, f"importing {len(exports)} allocations from pool {self.name!r}") from exc
        return out

    def _map_chunks(self, export: Export, stream: Any, fds: list[int]) -> ImportedMemory:
        """Memory above the import limit: its VMM chunks mapped into one range of ours."""
        try:
            with _OnDevice(self.device):
                mapping = vmm.Mapping(self.device, vmm.granularity(self.device))
                mapping.extend(list(export.chunks), fds)
                fds = []
                try:
                    s = self._backend.stream(stream, self.device)
                    if export.ready_event:   # a sealed object's writer: R1 as for any lease
                        _order_after(s, export.ready_event, self._backend.event_spin_s)
                    view = Buffer.from_handle(mapping.ptr, export.size)
                except BaseException:
                    mapping.close()
                    raise
        except CUDAError as exc:
            raise _translate(exc, f"mapping {export.size} bytes of pool {self.name!r}") from exc
        finally:
            for fd in fds:
                os.close(fd)
        return CudaMemory(view, export.size, self.device, mapping=mapping)

    def order_after(self, event: bytes, stream: Any = None) -> None:
        if not event:
            return
        try:
            with _OnDevice(self.device):
                _order_after(self._backend.stream(stream, self.device), event, self._backend.event_spin_s)
        except CUDAError as exc:
            raise _translate(exc, f"ordering after a seal of pool {self.name!r}") from exc

    def carved(self, arena: ImportedMemory, offset: int, nbytes: int) -> ImportedMemory:
        if not isinstance(arena, CudaMemory) or arena.slab() is None:
            raise InvalidRequest("an arena is a range of a slab")
        if offset + nbytes > arena.size:
            raise InvalidRequest("a carved range lies outside its arena")
        return CudaMemory(None, nbytes, self.device, whole=False, base=(arena.slab()[0], arena.slab()[1] + offset))

    def idle_marker(self, stream: Any = None) -> Any:
        with _OnDevice(self.device):
            return self._backend.stream(stream, self.device).record()

    def _range(self, export: Export) -> CudaMemory:
        """A range of a slab: a view into the slab's one import (no pointer import of its own)."""
        return CudaMemory(None, export.size, self.device, whole=False, base=(self._slab(export.data), export.offset))

    def _slab(self, data: bytes) -> CudaMemory:
        """A slab of the broker's, imported once (slabs live as long as the pool)."""
        slab = self._slabs.get(data)
        if slab is None:
            desc = IPCBufferDescriptor._init(bytes(data), self.slab_size)
            # Never freed through this import while the pool lives; closed with the pool.
            buf = Buffer.from_ipc_descriptor(self._mr, desc, stream=LEGACY_DEFAULT_STREAM)
            slab = self._slabs[data] = CudaMemory(buf, self.slab_size, self.device, whole=False)
        return slab

    def release(self, memory: ImportedMemory, stream: Any = None, credit: bytes = b"") -> bytes:
        if not isinstance(memory, CudaMemory):
            raise InvalidRequest(f"not CUDA memory: {type(memory).__name__}")
        buf = memory._take()
        if memory.mapping is not None:
            # Unmapping does not wait for the GPU: finish the caller's work on it first. The
            # memory is idle then, so the broker needs no done event.
            with _OnDevice(self.device):
                self._backend.stream(stream, self.device).sync()
                memory.mapping.close()
            return b""
        try:
            with _OnDevice(self.device):
                s = self._backend.stream(stream, self.device)
                if memory.whole:
                    buf.close(stream=s)          # cudaFreeAsync of the import, after work on s
                if credit:   # R2 on the broker's own event: it lives as long as the broker needs
                    record_into(s, credit)
                    return credit
                with _OnStream(s):
                    event, handle = record_ipc(s)   # R2: the broker frees (or reuses) after this
        except CUDAError as exc:
            raise _translate(exc, f"releasing memory of pool {self.name!r}") from exc
        self._backend.keep_done(event)
        return handle

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for slab in self._slabs.values():
            slab.buffer.close(stream=LEGACY_DEFAULT_STREAM)
        self._slabs.clear()
        self._mr.close()


class CudaClientGrowable(ClientGrowable):
    """A growable buffer mapped here: a ``cuda_vmm.Mapping`` with room to grow in place."""

    def __init__(self, device: int, gran: int):
        _check_device(device)
        self.device = device
        self._mapping = vmm.Mapping(device, gran, headroom=2)

    ptr = property(lambda self: self._mapping.ptr)
    size = property(lambda self: self._mapping.size)
    reserved = property(lambda self: self._mapping.reserved)

    def extend(self, chunks: list[int], fds: list[int]) -> bool:
        with _OnDevice(self.device):
            return self._mapping.extend(chunks, fds)

    def close(self) -> None:
        # cuMemUnmap does not wait for the GPU: let this device's work finish first.
        with _OnDevice(self.device):
            drv.check(drv.cu.cuCtxSynchronize(), "cuCtxSynchronize")
            self._mapping.close()


class CudaClientBackend(ClientBackend):
    name = "cuda"
    array_module = "cupy"
    on_gpu = True

    def __init__(self) -> None:
        try:
            with _OnDevice(0):
                pass
        except (CUDAError, RuntimeError, OSError) as exc:
            raise BackendUnavailable(f"CUDA is not usable here: {exc}") from exc
        self._replies = 0
        # How long a reader polls a pending seal event on the host before a stream wait (R1).
        self.event_spin_s = int(os.environ.get("IPCPOOL_EVENT_SPIN_US", "2000")) / 1e6
        self._foreign: dict[int, Stream] = {}
        # Done events we recorded, with the reply count when recorded. One is destroyed once the
        # broker has certainly opened it (two replies later: a reply means the broker read every
        # earlier message) and it has completed.
        self._done: collections.deque[tuple[int, Any]] = collections.deque()
        self._lock = threading.Lock()
        self._closed = False

    def import_pool(self, info: dict[str, Any], fd: int) -> ClientPool:
        try:
            return CudaClientPool(self, info, fd)
        except (KeyError, TypeError, ValueError) as exc:
            raise BackendUnavailable(f"bad pool info for {info.get('name')!r}: {exc}") from exc

    def import_growable(self, info: dict[str, Any]) -> ClientGrowable:
        try:
            return CudaClientGrowable(int(info["device"]), int(info["granularity"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise BackendUnavailable(f"bad growable info {info!r}: {exc}") from exc

    # -- streams
    def stream(self, obj: Any, device: int) -> Stream:
        """Normalise what a caller may pass as a stream to a cuda.core Stream.

        None is CUDA's legacy default stream (what torch and cupy use unless told otherwise), so
        that code which never names a stream is still ordered after the ready event.
        """
        if obj is None:
            return LEGACY_DEFAULT_STREAM
        if isinstance(obj, Stream):
            return obj
        if isinstance(obj, int) and not isinstance(obj, bool):
            if obj in (0, 1):
                return LEGACY_DEFAULT_STREAM
            if obj == 2:
                return PER_THREAD_DEFAULT_STREAM
            return Stream.from_handle(obj)
        if hasattr(obj, "__cuda_stream__"):
            _, handle = obj.__cuda_stream__()
            if handle in (0, 1):
                return LEGACY_DEFAULT_STREAM
            if handle == 2:
                return PER_THREAD_DEFAULT_STREAM
            # A non-owning wrapper per foreign stream, kept: a handle reused by a later stream
            # is that stream, so the wrapper stays right.
            wrapped = self._foreign.get(handle)
            if wrapped is None:
                if len(self._foreign) >= 256:
                    self._foreign.pop(next(iter(self._foreign)))
                wrapped = self._foreign[handle] = Device(device).create_stream(obj)
            return wrapped
        for attr in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy Stream
            handle = getattr(obj, attr, None)
            if isinstance(handle, int):
                return self.stream(handle, device)
        raise InvalidRequest(f"cannot use {type(obj).__name__} as a CUDA stream")

    # -- done events (R4)
    def keep_done(self, event: Any) -> None:
        with self._lock:
            self._done.append((self._replies, event))

    def broker_progressed(self) -> None:
        with self._lock:
            self._replies += 1
            while self._done and self._done[0][0] + 2 <= self._replies and self._done[0][1].is_done:
                self._done.popleft()[1].close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            # Our frees must have run before the events go: the broker may still be about to open
            # them (if it cannot, it frees at once, which is safe only after our frees completed).
            while self._done:
                _, event = self._done.popleft()
                event.sync()
                event.close()
