"""The pool memory a client carves objects from without a round trip (see ``handoff``).

An arena is an allocation of the client's, imported once; the client keeps its free ranges (the
broker mirrors them, ``broker/arenas.py``) and its block of words on the pool's seal board.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..ranges import RangeAllocator
from ..backend.base import ClientPool, ImportedMemory
from ..errors import IpcPoolError, OutOfMemory
from ..protocol import ARENA_ALIGN
from ..shm import sealboard


class ClientArena:
    """Pool memory this client carves from, and its block of the pool's seal board."""

    def __init__(self, aid: int, pool: ClientPool, memory: ImportedMemory, words: int | None):
        self.aid = aid
        self.pool = pool
        self.memory = memory
        self.ranges = RangeAllocator(memory.size, ARENA_ALIGN)   # the broker rounds alike
        self.words = words   # the first word of its board block, or None (no block left)
        self._slots = list(range(sealboard.BLOCK - 1, -1, -1)) if words is not None else []
        self._seq = 0
        self._cooling: list[tuple[int, Any]] = []   # refused ranges, until their work finished
        # Reclaimed ranges kept taken, by rounded size: a writer handing off objects of one size
        # carves each from the last one's range (a list pop, where the allocator's best fit costs
        # ~8 µs a carve on an H100 host). Given back to the allocator when it runs out of room.
        self._spare: dict[int, list[int]] = {}

    def carve(self, nbytes: int) -> int | None:
        """An offset for ``nbytes``, or None when the arena has no room."""
        if self._cooling:
            self._cool()
        spare = self._spare.get(self.ranges.rounded(nbytes))
        if spare:
            return spare.pop()
        try:
            return self.ranges.allocate(nbytes)
        except OutOfMemory:
            if not any(self._spare.values()):
                return None
        for offsets in self._spare.values():   # room for another size: the spares go back
            for offset in offsets:
                self.ranges.free(offset)
        self._spare.clear()
        try:
            return self.ranges.allocate(nbytes)
        except OutOfMemory:
            return None

    def holds(self, offset: int) -> bool:
        """Whether the range at ``offset`` is carved out (neither free nor a spare)."""
        return self.ranges.taken(offset) and offset not in self._spare.get(self.ranges.size_of(offset), ())

    def slot(self) -> tuple[int, int] | None:
        """A free board word of this arena and the next number (numbers only grow)."""
        if not self._slots:
            return None
        self._seq += 1
        return self._slots.pop(), self._seq

    def free_slot(self, slot: int) -> None:
        self._slots.append(slot)

    def memory_at(self, offset: int, nbytes: int) -> ImportedMemory:
        return self.pool.carved(self.memory, offset, nbytes)

    def reclaimed(self, offset: int) -> None:
        """The broker says the range at ``offset`` is idle: every importer is done with it."""
        if self.ranges.taken(offset):   # (a stale notice of a refused range: never taken)
            self._spare.setdefault(self.ranges.size_of(offset), []).append(offset)

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


@dataclasses.dataclass(slots=True)
class Carving:
    """A buffer carved here: where, its request (until the reply), and its board word."""

    arena: ClientArena
    offset: int
    rid: int
    slot: int | None = None
    seq: int = 0
    promise: bytes = b""        # the credit its seal will be recorded on (CUDA)
    error: IpcPoolError | None = None
    stream: Any = None          # where its last work was queued (a refusal frees it after)
    sent: bool = False          # its seal (or free) went out before the reply came
    framed: bool = False        # its create went as a frame on the control socket (``ipcpool.frames``)
    memory: ImportedMemory | None = None   # the range, imported: what its buffer holds
