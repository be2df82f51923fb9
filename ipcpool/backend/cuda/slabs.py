"""Slabs: pool allocations that small allocations are carved from, one pool's set of them."""

from __future__ import annotations

from collections.abc import Callable

from cuda.core import Buffer, DeviceMemoryResource, Stream

from ...errors import OutOfMemory
from ..allocator import RangeAllocator
from .descriptors import export_pointer
from .errors import is_cuda_error, translate
from .limits import SLAB_ALIGN, SLAB_SIZE


class Slab:
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


class Slabs:
    """The slabs of one pool, and how many bytes of their ranges are in use (``used``: the pool
    counts those as used, not the whole slabs the driver counts)."""

    def __init__(self, name: str, mr: DeviceMemoryResource, max_size: int, reaper: Callable[[], Stream]):
        # A slab is at most 1 GiB (under the import limit) and at most an eighth of a bounded
        # pool; allocations up to a sixteenth of a slab are carved from slabs.
        bound = max_size // 8 if max_size else SLAB_SIZE
        self.size = max(2 << 20, min(SLAB_SIZE, bound) // (2 << 20) * (2 << 20))
        self.item_max = self.size // 16
        self.used = 0
        self._name = name
        self._mr = mr
        self._reaper = reaper   # the backend's stream of the pool's device (made on first use)
        self._slabs: list[Slab] = []

    @property
    def reserved(self) -> int:
        return len(self._slabs) * self.size

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
        stream = self._reaper()
        try:
            buf = self._mr.allocate(self.size, stream=stream)
        except Exception as exc:
            if not is_cuda_error(exc):
                raise
            raise translate(exc, f"pool {self._name!r} cannot reserve a {self.size}-byte slab") from exc
        stream.sync()   # rare (once per slab): afterwards no range of it ever needs a ready event
        try:
            data = export_pointer(buf)
        except BaseException:
            buf.close(stream=stream)   # not kept: give it back at once
            raise
        slab = Slab(buf, data, self.size)
        self._slabs.append(slab)
        return slab

    def close(self) -> None:
        for slab in self._slabs:
            slab.buffer.close(stream=self._reaper())
        self._slabs.clear()
