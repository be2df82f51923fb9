"""Slabs: the allocations that small allocations are carved from, one pool's set of them."""

from __future__ import annotations

import secrets
from collections.abc import Callable

from cuda.core import Buffer, DeviceMemoryResource, Stream

from ...errors import OutOfMemory
from ...ranges import RangeAllocator
from . import vmm
from .context import OnDevice
from .descriptors import export_pointer
from .errors import cuda_errors
from .limits import SLAB_ALIGN, SLAB_SIZE


class Slab:
    """One pool allocation that small allocations are carved from. Clients import it once and
    address its ranges by offset, so a small allocation costs the broker no driver call and the
    client no pointer import. A range goes back to the slab only once every importer's done event
    has completed (the same markers as a free: R2), so a range is idle on the GPU when it is handed
    out again and needs no ready event. Slabs live as long as their pool: a client's cached import
    must never outlive the memory it maps.

    A slab is a pool allocation (``buffer``; ``data`` is its pointer export) or, in a pool whose
    slabs are VMM memory, one cuMemCreate chunk (``chunk``; ``data`` is a random key that names it,
    and clients map it from its FD): a fresh process maps a GiB of VMM memory ten times faster than
    it imports a GiB pool pointer (bench/attach_floor.py)."""

    __slots__ = ("buffer", "chunk", "data", "ranges")

    def __init__(self, buffer: Buffer | None, data: bytes, size: int, chunk: vmm.Chunk | None = None):
        self.buffer = buffer
        self.chunk = chunk
        self.data = data
        self.ranges = RangeAllocator(size, SLAB_ALIGN)

    @property
    def chunks(self) -> tuple[int, ...]:
        """What an export of one of its ranges says of the memory: the chunk a client maps."""
        return (self.chunk.size,) if self.chunk is not None else ()


class Slabs:
    """The slabs of one pool, and how many bytes of their ranges are in use (``used``: the pool
    counts those as used, not the whole slabs the driver counts)."""

    def __init__(self, name: str, mr: DeviceMemoryResource, max_size: int, reaper: Callable[[], Stream],
                 vmm_device: int | None = None, room: Callable[[int], None] = lambda n: None):
        # A slab is at most 1 GiB (under the import limit) and at most an eighth of a bounded
        # pool; allocations up to a sixteenth of a slab are carved from slabs.
        bound = max_size // 8 if max_size else SLAB_SIZE
        self.size = max(2 << 20, min(SLAB_SIZE, bound) // (2 << 20) * (2 << 20))
        self.item_max = self.size // 16
        self.used = 0
        self._name = name
        self._mr = mr
        self._reaper = reaper   # the backend's stream of the pool's device (made on first use)
        self._vmm_device = vmm_device   # set: slabs are VMM chunks on this device
        self._room = room               # raises OutOfMemory where a VMM slab would pass max_size
        self._slabs: list[Slab] = []

    @property
    def reserved(self) -> int:
        return len(self._slabs) * self.size

    @property
    def pool_reserved(self) -> int:
        """Bytes of slabs that are pool allocations (the driver counts them in the pool's use)."""
        return 0 if self._vmm_device is not None else self.reserved

    def take(self, nbytes: int) -> tuple[Slab, int]:
        """A range of ``nbytes`` in some slab (a new one where none has room): (slab, offset)."""
        for slab in self._slabs:
            try:
                offset = slab.ranges.allocate(nbytes)
                break
            except OutOfMemory:
                continue
        else:
            slab = self._new_slab()
            offset = slab.ranges.allocate(nbytes)
        self.used += slab.ranges.rounded(nbytes)
        return slab, offset

    def _new_slab(self) -> Slab:
        if self._vmm_device is not None:
            return self._new_vmm_slab()
        stream = self._reaper()
        with cuda_errors("pool %r cannot reserve a %s-byte slab", self._name, self.size):
            buf = self._mr.allocate(self.size, stream=stream)
        stream.sync()   # rare (once per slab): afterwards no range of it ever needs a ready event
        try:
            data = export_pointer(buf)
        except BaseException:
            buf.close(stream=stream)   # not kept: give it back at once
            raise
        slab = Slab(buf, data, self.size)
        self._slabs.append(slab)
        return slab

    def _new_vmm_slab(self) -> Slab:
        self._room(self.size)
        with cuda_errors("pool %r cannot reserve a %s-byte slab", self._name, self.size):
            with OnDevice(self._vmm_device):   # synchronous: idle when made, like a pool slab after its sync
                chunk = vmm.create_chunks(self._vmm_device, [self.size], False)[0]
        slab = Slab(None, secrets.token_bytes(64), self.size, chunk)
        self._slabs.append(slab)
        return slab

    def close(self) -> None:
        for slab in self._slabs:
            if slab.chunk is not None:   # clients that mapped it keep the memory until they unmap
                with OnDevice(self._vmm_device):
                    slab.chunk.close()
            else:
                slab.buffer.close(stream=self._reaper())
        self._slabs.clear()
