"""The record of one allocation a CUDA pool handed out (the broker's opaque handle)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cuda.core import Buffer

from ...errors import InvalidRequest
from . import vmm
from .slabs import Slab

class Allocation:
    """One allocation of a ``CudaPool``, the opaque handle the broker holds. One record serves the
    four kinds of memory a pool hands out, told apart by which field is set:

    - a pool allocation: ``buffer`` (its pointer export is what clients import), ``ready`` set;
    - a range of a slab: ``slab`` and ``offset`` (no buffer, no ready event: idle when handed out);
      ``parts`` once a shrunk arena keeps only some of its range;
    - a range carved from an arena (itself a slab range): ``on_idle`` as well;
    - memory above the import limit: ``chunks`` (VMM).

    Every kind shares the free's ordering (``waits``, R2) and a named object's seal (``sealed``,
    ``seal_done``, ``extra``), which is most of the record; the kinds stay one class so that the
    free queue, the seals and the broker handle them alike.
    """

    __slots__ = ("buffer", "chunks", "extra", "freed", "offset", "on_idle", "parts", "ready", "seal_done", "sealed",
                 "size", "slab", "waits")

    def __init__(self, buffer: Buffer | None, size: int, ready: Any, slab: Slab | None = None, offset: int = 0,
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
        self.waits: list = []  # ordering.DoneWait: importers' done events the free must follow (R2)
        self.freed = False
        self.on_idle: Callable[[], None] | None = None   # a range carved from an arena: its memory stays the arena's
        self.parts: dict[int, int] | None = None   # a shrunk arena: the slab ranges it still keeps


def as_alloc(handle: object) -> Allocation:
    if not isinstance(handle, Allocation):
        raise InvalidRequest(f"not a CUDA allocation: {type(handle).__name__}")
    return handle
