"""A CUDA pool on the broker: a cuda.core ``DeviceMemoryResource`` with IPC enabled (pinned device
memory on the configured device, POSIX-FD handle type), its release threshold, reuse policies and
peer access set through the driver. Small allocations are ranges of slabs, large ones pool
allocations with a ready event each, and those above the import limit VMM chunks. Frees wait on
every importer's done event without blocking the host (R2): the backend runs them once settled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from cuda.core import DeviceMemoryResource, DeviceMemoryResourceOptions

from ...fds import close_all
from ...errors import BackendUnavailable, ClosedError, InvalidRequest, OutOfMemory
from ..base import REUSE_POLICIES, Arenas, BrokerPool, Export, PoolSpec, PoolStats, SessionContext, Usage
from . import driver as drv
from . import vmm
from .allocation import Allocation, as_alloc
from .context import OnDevice, check_device, make_current
from .descriptors import export_pointer
from .errors import cuda_errors
from .events import record_ipc, wait_for
from .limits import IMPORT_LIMIT, VMM_CHUNK
from .ordering import CudaOrdering, DoneWait, OrderingServices
from .session import as_session
from .slabs import Slabs


class PoolServices(OrderingServices, Protocol):
    """What a pool needs of the broker backend: its streams, its free queue and its sweeps (its
    ordering's among them)."""

    def defer_free(self, alloc: Allocation, free_now: Callable[[Allocation], None], owner: str) -> None:
        """Call ``free_now(alloc)`` once every done event of ``alloc`` has settled (R2)."""

    def query_streams(self) -> None: ...


class CudaPool(Arenas, Usage, BrokerPool):
    """Serves its arenas (slab ranges) and usage itself; its ordering is a ``CudaOrdering``."""

    def __init__(self, backend: PoolServices, spec: PoolSpec):
        self.spec = spec
        self._backend = backend
        self.device = spec.device
        self.ordering = CudaOrdering(backend, self.device)
        unknown = set(spec.reuse) - set(REUSE_POLICIES)
        if unknown:
            raise InvalidRequest(f"pool {spec.name!r}: unknown reuse policies {sorted(unknown)}")
        check_device(self.device)
        peers = sorted({p for p in spec.peer_access if p != self.device})
        for peer in peers:
            check_device(peer)
            if not drv.can_access_peer(peer, self.device):
                raise BackendUnavailable(
                    f"pool {spec.name!r}: device {peer} cannot access memory on device {self.device} "
                    f"(cuDeviceCanAccessPeer says no); remove it from peer_access"
                )
        make_current(self.device)
        with cuda_errors("creating pool %r on device %s", spec.name, self.device):
            self._mr = DeviceMemoryResource(
                self.device, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=spec.max_size)
            )
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
        device = self.device
        vmm_slabs = spec.slab_memory == "vmm"
        if vmm_slabs:
            vmm.check_supported(device)
        self._slabs = Slabs(spec.name, self._mr, spec.max_size, lambda: backend.reaper(device),
                            device if vmm_slabs else None, self._vmm_room)
        self.slab_size = self._slabs.size
        self.slab_item_max = self._slabs.item_max
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
            "slab_memory": self.spec.slab_memory,
        }

    @property
    def byte_limit(self) -> int:
        return self.spec.max_size

    # -- allocation
    def allocate(self, nbytes: int, session: SessionContext) -> tuple[object, Export]:
        if self._closed:
            raise ClosedError(f"pool {self.spec.name!r} is closed")
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidRequest(f"allocation size must be a positive integer, got {nbytes!r}")
        sess = as_session(session)
        self._backend.sweep()  # frees whose importers are done give their memory back first
        if nbytes > IMPORT_LIMIT:
            return self._allocate_vmm(nbytes)
        if nbytes <= self.slab_item_max:
            return self._carve(nbytes)
        stream = sess.stream(self.device)
        with cuda_errors("pool %r cannot allocate %s bytes", self.spec.name, nbytes):
            buf = self._mr.allocate(nbytes, stream=stream)
        try:
            data = export_pointer(buf)  # exported once, here
            ready, ready_handle = record_ipc(stream)
        except BaseException:
            buf.close(stream=stream)
            raise
        sess.graveyard.sweep()
        self._note_high()
        return Allocation(buf, nbytes, ready), Export(size=nbytes, offset=0, data=data, ready_event=ready_handle)

    @property
    def arena_limit(self) -> int:
        return self.slab_item_max   # arenas are slab ranges, so carving one needs no driver call

    def carve(self, handle: object, export: Export, offset: int, nbytes: int,
              on_idle: Callable[[], None]) -> tuple[object, Export]:
        arena = as_alloc(handle)
        if arena.slab is None or arena.freed:
            raise InvalidRequest("only a live slab range can be carved")
        alloc = Allocation(None, nbytes, None, arena.slab, arena.offset + offset)
        alloc.on_idle = on_idle
        return alloc, Export(size=nbytes, offset=arena.offset + offset, data=arena.slab.data, sub=True,
                             chunks=arena.slab.chunks)

    def _vmm_room(self, nbytes: int) -> None:
        """VMM memory is the pool's too: max_size bounds it (the driver bounds only pool memory)."""
        if self.spec.max_size and self._vmm_total() + nbytes > self.spec.max_size:
            raise OutOfMemory(f"pool {self.spec.name!r}: {nbytes} bytes more would pass its max_size")

    def _vmm_total(self) -> int:
        """Bytes of VMM memory: allocations above the import limit and VMM slabs."""
        return self._vmm_bytes + self._slabs.reserved - self._slabs.pool_reserved

    def _allocate_vmm(self, nbytes: int) -> tuple[object, Export]:
        """Memory a pool pointer import could not carry (see IMPORT_LIMIT): VMM chunks whose FDs
        the client maps into one range. cuMemCreate is synchronous: no ready event is needed."""
        self._vmm_room(nbytes)
        with OnDevice(self.device):
            vmm.check_supported(self.device)
            sizes = vmm.split(nbytes, vmm.granularity(self.device), VMM_CHUNK)
            chunks = vmm.create_chunks(self.device, sizes, False)
        self._vmm_bytes += sum(sizes)
        self._note_high()
        export = Export(size=nbytes, chunks=tuple(sizes))
        return Allocation(None, nbytes, None, chunks=chunks), export

    def chunk_fds(self, handle: object) -> list[int]:
        alloc = as_alloc(handle)
        if alloc.slab is not None:   # a range of a VMM slab: the slab's one chunk (Export.chunks)
            return [alloc.slab.chunk.fd] if alloc.slab.chunk is not None else []
        return [c.fd for c in alloc.chunks or ()]

    def restore(self, row: dict[str, Any], fds: list[int]) -> tuple[object, Export]:
        """A VMM-backed object a previous broker stored: its chunks, restored from their FDs, are
        ours again (and freed like any). Pool memory is restored by ``RestoredCudaPool`` instead."""
        sizes = [int(n) for n in row.get("chunks") or ()]
        if not sizes:
            close_all(fds)
            raise InvalidRequest(f"pool {self.spec.name!r} restores VMM chunks only")
        with OnDevice(self.device):
            chunks = vmm.restore_chunks(fds, sizes)
        self._vmm_bytes += sum(sizes)
        return Allocation(None, row["size"], None, chunks=chunks), Export(size=row["size"], chunks=tuple(sizes))

    def _carve(self, nbytes: int) -> tuple[object, Export]:
        slab, offset = self._slabs.take(nbytes)
        self._note_high()
        export = Export(size=nbytes, offset=offset, data=slab.data, sub=True, chunks=slab.chunks)
        return Allocation(None, nbytes, None, slab, offset), export

    def _note_high(self) -> None:
        """At every allocation: a peak between two stats calls (a swap's, say) is not missed."""
        self._used_high = max(self._used_high, self._used())

    def _used(self) -> int:
        """Bytes handed out: the driver's count, with each slab counted by its ranges in use."""
        return drv.get_u64(self._pool, "used") - self._slabs.pool_reserved + self._slabs.used + self._vmm_bytes

    def shrink(self, handle: object, keep: list[tuple[int, int]]) -> int:
        alloc = as_alloc(handle)
        if alloc.slab is None or alloc.freed or alloc.on_idle is not None or alloc.parts is not None:
            return 0
        ranges = alloc.slab.ranges
        given = ranges.free(alloc.offset)
        alloc.parts = {alloc.offset + off: ranges.reserve(alloc.offset + off, size) for off, size in keep}
        given -= sum(alloc.parts.values())
        self._slabs.used -= given
        return given

    def free_part(self, handle: object, offset: int) -> None:
        alloc = as_alloc(handle)
        size = alloc.parts.pop(alloc.offset + offset, None) if alloc.parts else None
        if size is not None:   # idle: every importer's done event completed (R2)
            alloc.slab.ranges.free(alloc.offset + offset)
            self._slabs.used -= size

    def free(self, handle: object, session: SessionContext, done_event: bytes = b"") -> None:
        """R2 without host synchronisation: the session's stream waits on the done event now, and
        the memory is freed on the backend's own stream once the marker after that wait (and after
        every ``add_release`` wait) has completed, as seen by polling at each later call into the
        backend, or once the client's process is gone (``peer_gone``). See ``DoneWait``."""
        alloc = as_alloc(handle)
        if alloc.freed:
            raise InvalidRequest("allocation freed twice")
        alloc.freed = True
        if done_event:
            alloc.waits.append(DoneWait(done_event, as_session(session), self.device))
        self._backend.defer_free(alloc, self._free_now, self.spec.name)

    def _free_now(self, alloc: Allocation) -> None:
        """Every importer is done: free on the backend's stream, after the allocation itself."""
        stream = self._backend.reaper(self.device)
        if alloc.slab is not None:   # every importer's done marker completed: the range is idle
            if alloc.on_idle is not None:
                alloc.on_idle()      # back to its arena (the arena's own range stays taken)
            elif alloc.parts is not None:   # a shrunk arena: what it still keeps
                for offset, size in alloc.parts.items():
                    alloc.slab.ranges.free(offset)
                    self._slabs.used -= size
                alloc.parts = {}
            else:
                alloc.slab.ranges.free(alloc.offset)
                self._slabs.used -= alloc.slab.ranges.rounded(alloc.size)
            if alloc.extra:
                self._backend.retire(stream, *alloc.extra)
            alloc.extra = []
            return
        if alloc.chunks is not None:   # every importer has unmapped (after its work) or is gone
            with OnDevice(self.device):
                for chunk in alloc.chunks:
                    chunk.close()
            self._vmm_bytes -= sum(c.size for c in alloc.chunks)
            alloc.chunks = []
            self._backend.retire(stream, *alloc.extra)
            alloc.extra = []
            return
        wait_for(stream, alloc.ready)  # (no wait on alloc.extra: a seal event may never complete)
        alloc.buffer.close(stream=stream)
        self._backend.retire(stream, alloc.ready, *alloc.extra)
        alloc.extra = []

    # -- statistics and policy
    def stats(self) -> PoolStats:
        self._backend.sweep()
        p = self._pool
        used = self._used()
        self._used_high = max(self._used_high, used)
        return PoolStats(
            reserved=drv.get_u64(p, "reserved") + self._vmm_total(),
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
        self._slabs.close()
        self._mr.close()  # also closes the exported FD; memory still in use is released later
