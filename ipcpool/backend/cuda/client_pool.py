"""A pool imported by a client: allocations imported from their export data, the caller's stream
ordered after each ready event (R1), and released with a done event for the broker (R2).

A pool is imported once from its FD; each allocation is imported from its 64-byte export data and
the caller's stream waits on its ready event. Releasing frees the import on the caller's stream
and records a fresh done event there for the broker to wait on. Slab ranges need neither: the
slab is imported once (a pool pointer, or a VMM chunk mapped from its FD) and a range is addressed
by its offset.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from cuda.bindings.driver import CUresult, cuEventQuery, cuEventRecord, cuStreamQuery
from cuda.core import LEGACY_DEFAULT_STREAM, Buffer, Device, DeviceMemoryResource, Stream

from ...errors import BackendUnavailable, ClosedError, InvalidRequest
from ...sizes import HANDLE_BYTES
from ..base import ClientPool, Export, ImportedMemory
from . import driver as drv
from . import vmm
from .context import OnDevice, OnStream, check_device
from .credits import CreditTable
from .descriptors import import_pointer
from .errors import cuda_errors
from .events import DriverEvent, open_ipc, record_into, record_ipc, record_marker, wait_for
from .memory import CudaMemory, PendingSlab, StreamSource


MAX_OPEN_CREDITS = 1024   # credits kept open per pool (a broker hands out few: they are recycled)


class ClientServices(StreamSource, Protocol):
    """What an imported pool needs of the client backend (``client.CudaClientBackend``)."""

    event_spin_s: float   # how long a reader polls a pending event before a stream wait (R1)

    def keep_done(self, event: Any) -> None:
        """Keep a done event of ours alive until the broker has certainly opened it (R4)."""

    def stream_handle(self, obj: Any, device: int) -> Any:
        """``stream(obj, device)``'s driver handle (a CUstream), kept for the last stream passed."""

    def background(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` on the backend's worker thread (slab imports)."""


def order_after_event(stream: Stream, handle: bytes, spin_s: float, opened: DriverEvent | None = None) -> None:
    """R1 on the host first: a stream wait on another process's IPC event costs ~270 µs on the GPU
    even when the event has completed (H100, driver 580), a query ~1 µs. So query; while pending,
    spin up to ``spin_s``; only then let ``stream`` wait, so correctness never depends on timing.
    The event is opened in the stream's context (a caller's stream may be on a peer device), unless
    it is ``opened`` already (a credit kept open: a query or a wait needs no context switch)."""
    if opened is not None:
        _query_or_wait(stream, opened, spin_s)
        return
    with OnStream(stream):
        event = open_ipc(handle)
        try:
            _query_or_wait(stream, event, spin_s)
        finally:
            event.close()


def _query_or_wait(stream: Stream, event: DriverEvent, spin_s: float) -> None:
    if not _done_within(event, spin_s) and not event.is_done:   # (is_done: a failed query raises)
        wait_for(stream, event)   # bound now, to the latest record (R4)


def _done_within(event: DriverEvent, spin_s: float) -> bool:
    """Whether ``event`` completes, queried (one driver call a look) for up to ``spin_s``; False
    also where a query fails (``is_done`` then says how)."""
    handle, until = event.handle, None
    err = cuEventQuery(handle)[0]
    while err == CUresult.CUDA_ERROR_NOT_READY:
        now = time.perf_counter()
        if until is None:   # (the clock read only once the first query says pending)
            until = now + spin_s
        if now >= until:
            return False
        err = cuEventQuery(handle)[0]
    return err == CUresult.CUDA_SUCCESS


class CudaClientPool(ClientPool):
    seal_event = True

    def __init__(self, backend: ClientServices, info: dict[str, Any], fd: int):
        self._backend = backend
        try:
            self.name = str(info.get("name", "?"))
            self.device = int(info["device"])
            peers = [int(p) for p in info.get("peer_access", ())]
            check_device(self.device)
            with cuda_errors("cannot import pool %r", self.name, error=BackendUnavailable), OnDevice(self.device):
                self._mr = DeviceMemoryResource.from_allocation_handle(self.device, fd)
        finally:
            os.close(fd)  # the imported pool holds its own reference
        try:
            # Access is per process: an importer on another device must grant itself access on its
            # imported pool, or copies fail (DESIGN.md). Grant every listed peer present here.
            count = drv.device_count()
            local_peers = [p for p in peers if p != self.device and p < count]
            if local_peers:
                drv.set_access(drv.pool_handle(self._mr), local_peers)
            self._peers = tuple(local_peers)   # granted on VMM-mapped allocations too
        except BaseException:
            self._mr.close()
            raise
        self.slab_size = int(info.get("slab_size", 0))
        self._slabs: dict[bytes, CudaMemory] = {}
        # The broker's credits opened once, by handle (they live as long as the broker and are
        # recycled, never destroyed: ``events.CreditStock``). Opening one costs ~10 µs (H100).
        self._credits: dict[bytes, DriverEvent] = {}
        self._table = CreditTable()   # (the same credits, as a reader's take in C finds them)
        self.open_credits = self._table.rows
        self._closed = False

    def needs_fds(self, export: Export) -> bool:
        return bool(export.chunks) and not (export.sub and export.data in self._slabs)

    def import_allocation(self, export: Export, stream: Any = None, fds: list[int] = ()) -> ImportedMemory:
        fds = list(fds)
        try:
            with cuda_errors("importing %s bytes from pool %r", export.size, self.name):
                if self._closed:
                    raise ClosedError(f"pool {self.name!r} is closed")
                if export.chunks and not export.sub:
                    fds, given = [], fds
                    return self._map_chunks(export, stream, given)
                if export.sub and export.offset + export.size > self.slab_size:
                    raise InvalidRequest("a slab range lies outside its slab")
                if export.sub and not export.ready_event and export.data in self._slabs:
                    return self._range(export)   # its slab is here, nothing to wait for: no driver call at all
                if len(export.data) != HANDLE_BYTES:
                    raise InvalidRequest(f"pointer export data is {HANDLE_BYTES} bytes, got {len(export.data)}")
                with OnDevice(self.device):
                    s = self._backend.stream(stream, self.device)
                    if export.ready_event:   # R1: before any use of the memory on s
                        order_after_event(s, export.ready_event, self._backend.event_spin_s)
                    if export.sub:
                        if export.chunks and export.data not in self._slabs:
                            fds, given = [], fds
                            self._map_slab(export, given)
                        return self._range(export)
                    buf = import_pointer(self._mr, export.data, export.size)
        finally:
            for fd in fds:   # those not handed on (a slab mapped already needs none)
                os.close(fd)
        return CudaMemory(buf, export.size, self.device)

    def import_many(self, exports: list[Export], stream: Any = None) -> list[ImportedMemory]:
        if self._closed:
            raise ClosedError(f"pool {self.name!r} is closed")
        for e in exports:   # all checked before any import: a bad one must not strand the others
            if len(e.data) != HANDLE_BYTES:
                raise InvalidRequest(f"pointer export data is {HANDLE_BYTES} bytes, got {len(e.data)}")
            if e.sub and e.offset + e.size > self.slab_size:
                raise InvalidRequest("a slab range lies outside its slab")
        out: list[ImportedMemory] = []
        # On a driver failure nothing half-imported stays behind (``undo``).
        with cuda_errors("importing %s allocations from pool %r", len(exports), self.name,
                         undo=lambda: self._undo(out, stream)), OnDevice(self.device):
            s = self._backend.stream(stream, self.device)
            for handle in dict.fromkeys(e.ready_event for e in exports if e.ready_event):
                order_after_event(s, handle, self._backend.event_spin_s)   # R1, once per distinct event
            # Pool slabs on the worker, in the order the ranges come: the leases need none yet.
            # (A VMM slab is mapped from its FD, in import_allocation.)
            for data in [d for d in dict.fromkeys(e.data for e in exports if e.sub and not e.chunks)
                         if d not in self._slabs]:
                self._pending(data, self._import_slab, data)
            for e in exports:
                if e.sub:
                    out.append(self._range(e))
                else:
                    out.append(CudaMemory(import_pointer(self._mr, e.data, e.size), e.size, self.device))
        return out

    def _undo(self, imported: list[ImportedMemory], stream: Any) -> None:
        """Free the imports of a batch that failed before the caller gives their leases back. Those
        go back with no done event for the broker to wait on, so the frees complete here first
        (R2; a host wait, on a failure path only)."""
        with OnDevice(self.device):
            s = self._backend.stream(stream, self.device)
            for mem in imported:
                buf = mem.detach()
                if buf is not None and mem.whole:
                    buf.close(stream=s)
            s.sync()

    def _map_chunks(self, export: Export, stream: Any, fds: list[int]) -> ImportedMemory:
        """Memory above the import limit: its VMM chunks mapped into one range of ours."""
        def r1() -> None:   # a sealed object's writer: R1 as for any lease
            if export.ready_event:
                order_after_event(self._backend.stream(stream, self.device), export.ready_event,
                                  self._backend.event_spin_s)

        view, mapping = self._mapped(list(export.chunks), fds, export.size, f"{export.size} bytes", r1)
        return CudaMemory(view, export.size, self.device, mapping=mapping)

    def _mapped(self, sizes: list[int], fds: list[int], nbytes: int, what: str,
                then: Callable[[], None] = lambda: None) -> tuple[Buffer, vmm.Mapping]:
        """Chunks mapped one after another into a range of ours from their FDs (owned: closed,
        also on a failure), as a Buffer of ``nbytes``; ``then`` runs once they are mapped. Here,
        or on the worker thread for a VMM slab."""
        try:
            with cuda_errors("mapping %s of pool %r", what, self.name), OnDevice(self.device):
                mapping = vmm.Mapping(self.device, vmm.granularity(self.device), peers=self._peers)
                given, fds = fds, []
                mapping.extend(sizes, given)   # (closes them, also when it fails)
                try:
                    then()
                    return Buffer.from_handle(mapping.ptr, nbytes), mapping
                except BaseException:
                    mapping.close()
                    raise
        finally:
            for fd in fds:
                os.close(fd)

    def order_after(self, event: bytes, stream: Any = None, credit: bool = False) -> None:
        if not event:
            return
        opened = self._credits.get(event) if credit else None
        if opened is not None:   # the usual reader of a hand-off, without the general way's set-up
            query = self.query_event   # (complete already, where it is read once sealed: one C call)
            if query is not None and query(opened.ptr) == 0:
                return
            if _done_within(opened, self._backend.event_spin_s):
                return   # (its writer posts the seal as soon as it recorded: the fill often runs a few µs more)
        with cuda_errors("ordering after a seal of pool %r", self.name):
            s = self._backend.stream(stream, self.device)
            if credit:   # kept open: no context switch (spun for above where it was open already)
                spin_s = 0.0 if opened is not None else self._backend.event_spin_s
                order_after_event(s, event, spin_s, self._opened(event))
                return
            with OnDevice(self.device):
                order_after_event(s, event, self._backend.event_spin_s)

    def _opened(self, handle: bytes) -> DriverEvent:
        """The broker's credit ``handle``, opened in this pool's device context once."""
        event = self._credits.get(handle)
        if event is None:
            if len(self._credits) >= MAX_OPEN_CREDITS:   # bounded: the oldest goes
                oldest = next(iter(self._credits))
                self._table.drop(oldest)   # (out of the table before its event closes)
                self._credits.pop(oldest).close()
            with OnDevice(self.device):
                event = self._credits[handle] = open_ipc(handle)
            self._table.put(handle, event.ptr)
        return event

    def carved(self, arena: ImportedMemory, offset: int, nbytes: int) -> ImportedMemory:
        if not isinstance(arena, CudaMemory) or arena.slab() is None:
            raise InvalidRequest("an arena is a range of a slab")
        if offset + nbytes > arena.size:
            raise InvalidRequest("a carved range lies outside its arena")
        return CudaMemory(None, nbytes, self.device, whole=False, base=(arena.slab()[0], arena.slab()[1] + offset))

    def idle_marker(self, stream: Any = None) -> Any:
        with OnDevice(self.device):
            return self._backend.stream(stream, self.device).record()

    def _range(self, export: Export) -> CudaMemory:
        """A range of a slab: a view into the slab's one import (no pointer import of its own)."""
        return CudaMemory(None, export.size, self.device, whole=False, base=(self._slab(export), export.offset))

    def _slab(self, export: Export) -> CudaMemory:
        """A slab of the broker's, imported once (slabs live as long as the pool)."""
        slab = self._slabs.get(export.data)
        if slab is None:
            if export.chunks:   # a VMM slab is mapped from its FD (import_allocation), never here
                raise InvalidRequest("a range of a VMM slab came without the slab's FD")
            # Never freed through this import while the pool lives; closed with the pool.
            buf, _ = self._import_slab(export.data)
            slab = self._slabs[export.data] = CudaMemory(buf, self.slab_size, self.device, whole=False)
        return slab

    def _import_slab(self, data: bytes) -> tuple[Buffer, None]:
        """A slab's pool pointer imported (here or on the worker thread)."""
        with cuda_errors("importing a slab of pool %r", self.name):
            with OnDevice(self.device):
                return import_pointer(self._mr, data, self.slab_size), None

    def _map_slab(self, export: Export, fds: list[int]) -> None:
        """A VMM slab mapped from its chunk's FD (owned; closed by the worker), kept as long as the pool."""
        if tuple(export.chunks) != (self.slab_size,) or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise InvalidRequest(f"a VMM slab is one chunk of {self.slab_size} bytes with its FD")
        self._pending(export.data, self._mapped, [self.slab_size], fds, self.slab_size, "a slab")

    def _pending(self, data: bytes, job: Callable[..., tuple[Buffer, Any]], *args: Any) -> None:
        future = self._backend.background(job, *args)
        self._slabs[data] = PendingSlab(future, self.slab_size, self.device, lambda: self._slabs.pop(data, None))

    def release(self, memory: ImportedMemory, stream: Any = None, credit: bytes = b"", *,
                if_busy: bool = False) -> bytes:
        if not isinstance(memory, CudaMemory):
            raise InvalidRequest(f"not CUDA memory: {type(memory).__name__}")
        buf = memory.detach()
        if if_busy and stream is not None and memory.mapping is None and not memory.whole:
            # A reader's release after a read the host waited for (``.item()``, a copy out): the
            # range is idle, and an event recorded now would be GPU work of this process between
            # a writer's next fill and its readers' copies (on an H100, another process's IPC
            # event record every 100 µs made a floor hand-off 4x slower). One query, no work.
            (err,) = cuStreamQuery(self._backend.stream_handle(stream, self.device))
            if err == CUresult.CUDA_SUCCESS:
                return b""
        if memory.mapping is not None:
            # Unmapping does not wait for the GPU: finish the caller's work on it first. The
            # memory is idle then, so the broker needs no done event.
            with OnDevice(self.device):
                self._backend.stream(stream, self.device).sync()
                memory.mapping.close()
            return b""
        opened = self._credits.get(credit) if credit and not memory.whole else None
        if opened is not None:   # a range (a hand-off's seal): nothing to free; one driver call
            (err,) = cuEventRecord(opened.handle, self._backend.stream_handle(stream, self.device))
            if err == CUresult.CUDA_SUCCESS:
                return credit   # R2 on the broker's own event: it lives as long as the broker needs
        with cuda_errors("releasing memory of pool %r", self.name):
            s = self._backend.stream(stream, self.device)
            if credit and not memory.whole and opened is None:   # (a credit opened here first)
                (err,) = cuEventRecord(self._opened(credit).handle, s.handle)
                if err == CUresult.CUDA_SUCCESS:
                    return credit
                # (a stream of another device's context: recorded below, in the stream's)
            with OnDevice(self.device):
                if memory.whole:
                    buf.close(stream=s)          # cudaFreeAsync of the import, after work on s
                if credit:   # R2 on the broker's own event: it lives as long as the broker needs
                    record_into(s, credit)
                    return credit
                event, handle = record_ipc(s)   # R2: the broker frees (or reuses) after this
        self._backend.keep_done(event)
        return handle

    def seal_target(self, memory: ImportedMemory, credit: bytes) -> tuple[Any, Callable[[], Any] | None] | None:
        if not credit or not isinstance(memory, CudaMemory) or memory.whole or memory.mapping is not None:
            return None
        with cuda_errors("opening a seal credit of pool %r", self.name):
            return self._opened(credit), memory.detach   # (the credit opened now: before the seal, off its path)

    def stream_int(self, stream: Any) -> int:
        return int(self._backend.stream_handle(stream, self.device))

    def seal_range(self, memory: ImportedMemory, stream: Any, credit: bytes, board: Any, word: int, seq: int) -> bool:
        # A seal the one-call seal does not serve (``Handoff._seal_apart``): the record and the post
        # still in one C call (``shm.sealboard.Board.post_after``), where ``release`` and the post
        # cost a writer on a cold CPU ~9 µs before its readers may go on.
        opened = self._credits.get(credit)
        if (opened is None or not isinstance(memory, CudaMemory) or memory.whole or memory.mapping is not None
                or memory.released):
            return False
        stream_handle = self._backend.stream_handle(stream, self.device)
        if board.post_after(opened.ptr, int(stream_handle), word, seq) != 0:
            return False   # (a stream of another context, say: ``release`` records it there)
        memory.detach()
        return True

    def keep(self, memory: ImportedMemory, stream: Any = None, credit: bytes = b"") -> tuple[bytes, Any] | None:
        """VMM-mapped memory (a shard above the import limit) stays mapped: ``release`` would wait
        on the host for the caller's work (the copy into a version, the whole of it) and unmap
        every chunk, and the writer given this memory back as its next spare would fetch the FDs,
        import, map and grant access again. Here only the done event is recorded (on ``credit``
        where given, R2: readers of the seal order after it on the GPU, R1), with a marker of ours
        after it: ``drop_kept`` waits on that before it unmaps. Other memory: None (release it)."""
        if not isinstance(memory, CudaMemory) or memory.mapping is None or memory.released:
            return None
        with cuda_errors("keeping memory of pool %r mapped", self.name):
            with OnDevice(self.device):
                s = self._backend.stream(stream, self.device)
                if credit:
                    (err,) = cuEventRecord(self._opened(credit).handle, s.handle)
                    if err != CUresult.CUDA_SUCCESS:   # a stream of another device's context
                        record_into(s, credit)
                    done = credit
                else:
                    event, done = record_ipc(s)
                    self._backend.keep_done(event)
                marker = record_marker(s)
        return done, marker

    def drop_kept(self, memory: ImportedMemory, token: Any) -> None:
        """Unmap kept memory once the work before ``keep`` is done (its marker: long complete on
        the usual path, where the version was published a swap or more ago)."""
        if not isinstance(memory, CudaMemory) or memory.mapping is None or memory.released:
            return
        with cuda_errors("unmapping kept memory of pool %r", self.name):
            with OnDevice(self.device):
                if token is not None:
                    token.sync()
                    token.close()
                memory.detach()
                memory.mapping.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # The legacy default stream is the current context's: make it the pool device's, as every
        # other free of an import here is (the caller's thread may have another device's, or none).
        for slab in list(self._slabs.values()):   # imports still running finish first
            try:
                slab.ready()
            except Exception:   # noqa: BLE001 (a failed one holds nothing: it left the table)
                pass
        with OnDevice(self.device):
            if any(slab.mapping is not None for slab in self._slabs.values()):
                Device(self.device).sync()   # unmapping does not wait for work still using it
            for slab in self._slabs.values():
                if slab.mapping is not None:
                    slab.mapping.close()
                else:
                    slab.buffer.close(stream=LEGACY_DEFAULT_STREAM)
        self._slabs.clear()
        self._table.clear()
        for event in self._credits.values():
            event.close()
        self._credits.clear()
        self._mr.close()
