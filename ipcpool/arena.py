"""A client's arena: pool memory it carves its own objects from, so ``create`` needs no round trip.

The broker mirrors the carving (``broker/arenas.py``) and says when a range is idle again; a range
whose create the broker refused comes back here once the work queued on it has finished.
"""

from __future__ import annotations

import os
from typing import Any

from .backend.allocator import RangeAllocator
from .backend.base import ClientPool, ImportedMemory
from .errors import OutOfMemory
from .protocol import ARENA_ALIGN

# Bytes of one arena (the broker may grant less); 0 turns arenas off. Objects up to a quarter of
# an arena are carved from one.
ARENA_BYTES = int(os.environ.get("IPCPOOL_ARENA_BYTES", str(32 << 20)))


class ClientArena:
    def __init__(self, aid: int, pool: ClientPool, memory: ImportedMemory):
        self.aid = aid
        self.pool = pool
        self.memory = memory
        self.ranges = RangeAllocator(memory.size, ARENA_ALIGN)   # the broker rounds alike
        self._cooling: list[tuple[int, Any]] = []   # refused ranges, until their work finished

    def carve(self, nbytes: int) -> int | None:
        """An offset for ``nbytes``, or None when the arena has no room."""
        if self._cooling:
            self._cool()
        try:
            return self.ranges.allocate(nbytes)
        except OutOfMemory:
            return None

    def memory_at(self, offset: int, nbytes: int) -> ImportedMemory:
        return self.pool.carved(self.memory, offset, nbytes)

    def reclaimed(self, offset: int) -> None:
        """The broker says the range at ``offset`` is idle: every importer is done with it."""
        if self.ranges.taken(offset):   # (a stale notice of a refused range: never taken)
            self.ranges.free(offset)

    def refused(self, offset: int, stream: Any) -> None:
        """The broker never took this range: free it here once the work on ``stream`` is done."""
        self._cooling.append((offset, self.pool.idle_marker(stream)))

    def _cool(self) -> None:
        keep = []
        for offset, marker in self._cooling:
            if marker is None or marker.is_done:
                self.ranges.free(offset)
                if marker is not None:
                    marker.close()
            else:
                keep.append((offset, marker))
        self._cooling = keep
