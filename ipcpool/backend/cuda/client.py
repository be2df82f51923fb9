"""The CUDA client backend: imports pools and growables, turns what a caller passes as a stream
into a cuda.core Stream, and keeps its done events alive until the broker has opened them (R4)."""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from cuda.core import LEGACY_DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM, Device, Stream

from ...errors import BackendUnavailable, InvalidRequest, IpcPoolError
from ..base import ClientBackend, ClientGrowable, ClientPool
from . import driver as drv
from . import vmm
from .client_pool import CudaClientPool
from .context import OnDevice, check_device
from .errors import cuda_errors, usable


def growable_access(device: int, peers: list[int]) -> tuple[int, ...]:
    """The devices besides ``device`` to grant access to a growable mapped here: the pool's listed
    peers present in this process, and the calling thread's current device where that differs,
    each only where the driver says it can reach ``device``'s memory (cuDeviceCanAccessPeer).
    A current device that cannot is left out, not refused: it may be no choice of the caller's
    (the client backend leaves device 0's context current in a thread that had none)."""
    count = drv.device_count()
    here = drv.current_device()
    wanted = dict.fromkeys([*peers, *([here] if here is not None else [])])
    return tuple(p for p in wanted if p != device and 0 <= p < count and drv.can_access_peer(p, device))


class CudaClientGrowable(ClientGrowable):
    """A growable buffer mapped here: a ``vmm.Mapping`` with room to grow in place, which the
    growable's device and the peers ``growable_access`` finds may access."""

    def __init__(self, device: int, gran: int, peers: tuple[int, ...] | list[int] = (), span: int | None = None):
        check_device(device)
        self.device = device
        self.peers = growable_access(device, list(peers))
        # By default address space for the device's whole memory, where the driver grants it:
        # growth then maps in place, never at a new range nor after a reservation on the way.
        span = drv.total_memory(device) if span is None else span
        self._mapping = vmm.Mapping(device, gran, headroom=2, peers=self.peers, span=span)
        self._asked = (device, gran, tuple(peers))

    def matches(self, info: dict[str, Any]) -> bool:
        try:
            asked = (int(info["device"]), int(info["granularity"]), tuple(int(p) for p in info.get("peer_access", ())))
        except (KeyError, TypeError, ValueError):
            return False
        return asked == self._asked and self._mapping.size == 0

    ptr = property(lambda self: self._mapping.ptr)
    size = property(lambda self: self._mapping.size)
    reserved = property(lambda self: self._mapping.reserved)

    def extend(self, chunks: list[int], fds: list[int]) -> bool:
        with OnDevice(self.device):
            return self._mapping.extend(chunks, fds)

    def on_device(self) -> OnDevice:
        return OnDevice(self.device)

    def map_ahead(self, handles: list[tuple[Any, int]]) -> Any:
        with OnDevice(self.device):
            return self._mapping.map_ahead(handles)

    def keep(self, handles: list[tuple[Any, int]], token: Any) -> bool:
        if token is not None:   # mapped ahead: bookkeeping only, no driver call
            return self._mapping.keep(handles, token)
        with OnDevice(self.device):
            return self._mapping.keep(handles, token)

    def drop(self, token: Any) -> None:
        with OnDevice(self.device):
            self._mapping.drop(token)

    def close(self) -> None:
        # cuMemUnmap does not wait for the GPU: let the work of every device that may use the
        # mapping finish first (a peer's only where this process has its context active).
        for peer in self.peers:
            if drv.primary_active(peer):
                with OnDevice(peer):
                    drv.synchronize_context()
        with OnDevice(self.device):
            drv.synchronize_context()
            self._mapping.close()


class PlainDeviceMemory:
    """Device memory of this process's own (cuMemAlloc): what libraries that mis-read pool memory
    imported through IPC can take (``plain_device_memory``)."""

    def __init__(self, ptr: int, size: int, device: int):
        self.ptr, self.size, self.device = ptr, size, device

    def close(self) -> None:
        if self.ptr:
            with OnDevice(self.device):
                drv.free(self.ptr)   # cuMemFree waits for the work still using it
            self.ptr = 0


class CudaClientBackend(ClientBackend):
    name = "cuda"
    array_module = "cupy"
    on_gpu = True

    def __init__(self) -> None:
        with usable(), OnDevice(0):
            pass
        self._replies = 0
        # How long a reader polls a pending seal event on the host before a stream wait (R1).
        self.event_spin_s = int(os.environ.get("IPCPOOL_EVENT_SPIN_US", "2000")) / 1e6
        self._foreign: dict[int, Stream] = {}
        self._last_stream: tuple[Any, Stream | None] = (None, None)
        self._last_handle: tuple[Any, Any] = (None, None)   # (the last stream passed, its handle): ``stream_handle``
        # Done events we recorded, with the reply count when recorded. One is destroyed once the
        # broker has certainly opened it (two replies later: a reply means the broker read every
        # earlier message) and it has completed.
        self._done: collections.deque[tuple[int, Any]] = collections.deque()
        self._lock = threading.Lock()
        self._worker: ThreadPoolExecutor | None = None   # slab imports (client_pool), made when first needed
        self._stagers: dict[int, Any] = {}   # device -> PinnedStager, made by the first file load
        self._closed = False

    def import_pool(self, info: dict[str, Any], fd: int) -> ClientPool:
        try:
            return CudaClientPool(self, info, fd)
        except (KeyError, TypeError, ValueError) as exc:
            raise BackendUnavailable(f"bad pool info for {info.get('name')!r}: {exc}") from exc

    def prepare_growable(self, device: int, span: int | None = None) -> ClientGrowable | None:
        if span is not None and span <= 0:   # no span: the first chunks size the reservation
            return None
        try:
            g = CudaClientGrowable(device, vmm.granularity(device), (), span)
            with OnDevice(device):
                g._mapping.reserve_ahead()
            return g
        except IpcPoolError:   # the reply's info makes one as usual (and says why it cannot)
            return None

    def import_growable(self, info: dict[str, Any], span: int | None = None) -> ClientGrowable:
        try:
            return CudaClientGrowable(int(info["device"]), int(info["granularity"]),
                                      [int(p) for p in info.get("peer_access", ())], span)
        except (KeyError, TypeError, ValueError) as exc:
            raise BackendUnavailable(f"bad growable info {info!r}: {exc}") from exc

    def background(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` on the one worker thread (slab imports: client_pool)."""
        with self._lock:
            if self._worker is None:
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ipcpool-import")
            return self._worker.submit(fn, *args)

    # -- chunks lent ahead of grows (broker.loans)
    maps_loans = True

    def import_loaned(self, device: int, fd: int) -> Any:
        with OnDevice(device):
            return vmm.import_handle(fd)

    def release_loaned(self, device: int, handle: Any) -> None:
        with OnDevice(device):
            vmm.release_handle(handle)

    # -- streams
    def stream(self, obj: Any, device: int) -> Stream:
        """Normalise what a caller may pass as a stream to a cuda.core Stream.

        None is CUDA's legacy default stream (what torch and cupy use unless told otherwise), so
        that code which never names a stream is still ordered after the ready event.
        """
        if obj is None:
            return LEGACY_DEFAULT_STREAM
        last = self._last_stream   # the usual caller passes the same stream object every time
        if obj is last[0]:
            return last[1]
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
                with OnDevice(device):
                    wrapped = self._foreign[handle] = Device(device).create_stream(obj)
            # (kept with a reference to ``obj``: an id never names another object meanwhile, and
            # a stream object's handle does not change)
            self._last_stream = (obj, wrapped)
            return wrapped
        for attr in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy Stream
            handle = getattr(obj, attr, None)
            if isinstance(handle, int):
                return self.stream(handle, device)
        raise InvalidRequest(f"cannot use {type(obj).__name__} as a CUDA stream")

    def stream_handle(self, obj: Any, device: int) -> Any:
        """The driver handle of ``stream(obj, device)``: a cuda.core Stream builds a new CUstream
        on each ``.handle`` (~1 µs on an H100 host); a writer seals on one stream, so the last is kept."""
        last = self._last_handle
        if obj is last[0] and obj is not None:
            return last[1]
        handle = self.stream(obj, device).handle
        self._last_handle = (obj, handle)
        return handle

    # -- done events (R4)
    def keep_done(self, event: Any) -> None:
        with self._lock:
            self._done.append((self._replies, event))

    def broker_progressed(self) -> None:
        with self._lock:
            self._replies += 1
            while self._done and self._done[0][0] + 2 <= self._replies and self._done[0][1].is_done:
                self._done.popleft()[1].close()

    def read_files(self, jobs: list[tuple[int, int, Any, int, int]], stream: Any = None,
                   on_bytes: Callable[[int], None] | None = None) -> None:
        """File bytes to device memory through pinned buffers, reads and copies overlapped
        (``staging``); the copies are ordered on ``stream``."""
        from .staging import PinnedStager

        by_device: dict[int, list[tuple[int, int, int, int]]] = {}
        for fd, file_offset, memory, offset, nbytes in jobs:
            if nbytes:
                by_device.setdefault(memory.device, []).append((fd, file_offset, memory.ptr + offset, nbytes))
        for device, pieces in by_device.items():
            stager = self._stagers.get(device)
            if stager is None:
                stager = self._stagers[device] = PinnedStager(device)
            s = self.stream(stream, device)
            with cuda_errors("loading file bytes to the GPU"):
                stager.run(pieces, int(s.handle), on_bytes)

    def plain_device_memory(self, device: int, nbytes: int) -> PlainDeviceMemory:
        check_device(device)
        with cuda_errors("allocating %s bytes of device %s's memory", nbytes, device):
            with OnDevice(device):
                return PlainDeviceMemory(drv.alloc(nbytes), nbytes, device)

    def copy_memory(self, pieces: list[tuple[int, int, int]], device: int | None) -> None:
        """On the legacy default stream, which waited on the ready and seal events of what was
        imported without a stream (R1), then waited for: the bytes are there on return."""
        if device is None:
            super().copy_memory(pieces, device)
            return
        with cuda_errors("copying device memory"):
            with OnDevice(device):
                s = self.stream(None, device)
                for dst, src, nbytes in pieces:
                    drv.copy(dst, src, nbytes, int(s.handle))
                s.sync()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for stager in self._stagers.values():
            stager.close()
        self._stagers.clear()
        if self._worker is not None:   # (the pools waited for their imports already)
            self._worker.shutdown(wait=True)
        with self._lock:
            # Our frees must have run before the events go: the broker may still be about to open
            # them (if it cannot, it frees at once, which is safe only after our frees completed).
            while self._done:
                _, event = self._done.popleft()
                event.sync()
                event.close()
