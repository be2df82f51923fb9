"""Offsets inside one fixed-size region: best-fit, aligned, coalescing on free.

Pure logic (no I/O) that imports nothing of ipcpool but its errors, so every side can use it: the
backends' slabs and host pools, a client's arenas, the broker's mirror of them (``TakenRanges``),
the seal board's blocks. Free blocks are kept twice: by (size, offset) for best-fit lookups and by
offset (plus a map of block ends) so a freed block merges with both neighbours in O(log n).
"""

from __future__ import annotations

import bisect

from sortedcontainers import SortedList

from .errors import InvalidRequest, OutOfMemory


class RangeAllocator:
    def __init__(self, capacity: int, alignment: int = 256):
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError("alignment must be a power of two")
        self.capacity = capacity - capacity % alignment
        self.alignment = alignment
        self._by_size = SortedList()          # (size, offset) of free blocks
        self._start: dict[int, int] = {}      # free block offset -> size
        self._end: dict[int, int] = {}        # free block end -> offset
        self._used: dict[int, int] = {}       # allocated offset -> size
        self.used = 0
        if self.capacity:
            self._add_free(0, self.capacity)

    def _add_free(self, offset: int, size: int) -> None:
        self._by_size.add((size, offset))
        self._start[offset] = size
        self._end[offset + size] = offset

    def _remove_free(self, offset: int, size: int) -> None:
        self._by_size.remove((size, offset))
        del self._start[offset]
        del self._end[offset + size]

    def rounded(self, nbytes: int) -> int:
        return max(self.alignment, -(-nbytes // self.alignment) * self.alignment)

    def allocate(self, nbytes: int) -> int:
        if nbytes <= 0:
            raise InvalidRequest(f"allocation size must be positive, got {nbytes}")
        size = self.rounded(nbytes)
        i = self._by_size.bisect_left((size, -1))
        if i == len(self._by_size):
            free = self.capacity - self.used
            raise OutOfMemory(
                f"no free block of {size} bytes (pool of {self.capacity} bytes, {free} free"
                f"{', fragmented' if free >= size else ''}); free memory or raise the pool's max_size"
            )
        block_size, offset = self._by_size[i]
        self._remove_free(offset, block_size)
        if block_size > size:
            self._add_free(offset + size, block_size - size)
        self._used[offset] = size
        self.used += size
        return offset

    def reserve(self, offset: int, nbytes: int) -> int:
        """Take the block at exactly ``offset`` (re-adopting memory after a restart); returns the
        rounded size. The range must lie inside one free block."""
        size = self.rounded(nbytes)
        if offset % self.alignment:
            raise InvalidRequest(f"offset {offset} is not aligned to {self.alignment}")
        for start, length in self._start.items():
            if start <= offset and offset + size <= start + length:
                break
        else:
            raise InvalidRequest(f"range [{offset}, {offset + size}) is not free")
        self._remove_free(start, length)
        if offset > start:
            self._add_free(start, offset - start)
        if start + length > offset + size:
            self._add_free(offset + size, start + length - offset - size)
        self._used[offset] = size
        self.used += size
        return size

    def taken(self, offset: int) -> bool:
        return offset in self._used

    def size_of(self, offset: int) -> int:
        return self._used[offset]

    def offsets(self) -> list[int]:
        """Allocated offsets, in address order."""
        return sorted(self._used)

    def free(self, offset: int) -> int:
        """Free the block at ``offset``; return the (offset, size) of the merged free block's size."""
        size = self._used.pop(offset, None)
        if size is None:
            raise InvalidRequest(f"offset {offset} is not allocated")
        self.used -= size
        start, end = offset, offset + size
        if start in self._end:                 # merge with the free block before
            prev = self._end[start]
            self._remove_free(prev, start - prev)
            start = prev
        if end in self._start:                 # and with the one after
            nxt = self._start[end]
            self._remove_free(end, nxt)
            end += nxt
        self._add_free(start, end - start)
        return size

    def free_blocks(self) -> list[tuple[int, int]]:
        """Free (offset, size) blocks in address order."""
        return sorted(self._start.items())


class TakenRanges:
    """The ranges a peer took inside one region, to check each new one against: in bounds,
    aligned, overlapping none. A mirror of a client's own ``RangeAllocator``, kept by the broker:
    it never picks an offset, so it keeps the taken ranges alone (O(log n) to check one)."""

    def __init__(self, capacity: int, alignment: int):
        self.capacity = capacity - capacity % alignment
        self.alignment = alignment
        self._starts: list[int] = []     # taken offsets, sorted
        self._sizes: dict[int, int] = {}
        self.used = 0

    def rounded(self, nbytes: int) -> int:
        return max(self.alignment, -(-nbytes // self.alignment) * self.alignment)

    def reserve(self, offset: int, nbytes: int) -> int:
        size = self.rounded(nbytes)
        if offset % self.alignment:
            raise InvalidRequest(f"offset {offset} is not aligned to {self.alignment}")
        starts, sizes = self._starts, self._sizes
        i = bisect.bisect_right(starts, offset)
        end = offset + size
        if (end > self.capacity or (i and starts[i - 1] + sizes[starts[i - 1]] > offset)
                or (i < len(starts) and starts[i] < end)):
            raise InvalidRequest(f"range [{offset}, {end}) is not free")
        starts.insert(i, offset)
        sizes[offset] = size
        self.used += size
        return size

    def taken(self, offset: int) -> bool:
        return offset in self._sizes

    def shared(self) -> tuple[list[int], dict[int, int]]:
        """The taken starts (sorted) and their sizes, themselves: C takes a range in them as
        ``reserve`` does (``_native.usual_create``), then ``took`` counts it."""
        return self._starts, self._sizes

    def took(self, size: int) -> None:
        self.used += size

    def size_of(self, offset: int) -> int:
        return self._sizes[offset]

    def offsets(self) -> list[int]:
        return list(self._starts)

    def free(self, offset: int) -> int:
        size = self._sizes.pop(offset, None)
        if size is None:
            raise InvalidRequest(f"offset {offset} is not allocated")
        del self._starts[bisect.bisect_left(self._starts, offset)]
        self.used -= size
        return size
