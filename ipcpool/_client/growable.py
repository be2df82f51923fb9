"""A client's handle on a named growable buffer: one contiguous range that follows every grow.

Growth never copies. Where the address range right after the buffer is free the new chunks are
mapped there and the pointer stays; otherwise every chunk is mapped again at a new range and the
pointer moves. ``grow`` and ``sync`` return a ``Remap`` that says which happened. The old range
stays mapped (same memory) until ``close``, so work already queued on the old pointer is safe.

``sync()`` (also run by ``view`` and ``__cuda_array_interface__``) maps what other processes grew
before the next use. It never depends on the broker's notice of a grow having arrived: the grower's
reply comes on its control socket, the notice on ours, and the grower may tell this process to use
the new bytes before the notice gets here. On the host the memfd this process holds is as long as
the buffer, so sync reads its length. On CUDA sync reads the buffer's word on the growth board
(``ipcpool.shm.growboard``: mapped read-only, stamped by the broker at every grow before it answers
the grower): while it holds the stamp of this process's last mapping (from the last reply about
the buffer) nothing grew and sync returns at once; else it asks the broker (one round trip, whose
reply carries the FDs of the chunks this process lacks and the stamp to keep). A buffer without a
word (the board was full) or a session without a board asks at every sync.
Ordering of reads and writes across processes is the caller's, as for any shared buffer.

"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..backend.base import ClientGrowable
from ..errors import ClosedError, InvalidRequest

if TYPE_CHECKING:
    from .growables import Growables, _Fetch


@dataclass(frozen=True)
class Remap:
    """What a grow or sync did to this process's mapping."""

    grown: bool     # new chunks were mapped
    moved: bool     # the pointer changed: use ``ptr`` from now on (the old one stays valid until close)
    ptr: int
    size: int
    old_ptr: int


class GrowableBuffer:
    def __init__(self, growables: Growables, fields: dict, mapping: ClientGrowable):
        self._growables = growables
        self._mapping = mapping
        self.name: str = fields["name"]
        self.pool: str = str(fields.get("pool", ""))
        info = fields.get("info", {})
        self.device: int = int(info.get("device", -1))
        self.granularity: int = int(info.get("granularity", 0))
        self.compression: bool = bool(info.get("compression"))   # what the memory actually has
        self.compression_requested: bool = bool(fields.get("compression_requested"))
        self.generation = -1     # of the chunks mapped here
        self._announced = (fields["gen"], fields["size"], len(fields["chunks"]))   # the newest we were told of
        self._chunks = 0
        self._closed = False
        word = fields.get("word")   # on the growth board; -1: none (the board was full)
        self._word = word if isinstance(word, int) and not isinstance(word, bool) else -1
        self._stamp: int | None = None   # the word's stamp as of the last mapping from a reply

    # -- state
    @property
    def ptr(self) -> int:
        """The start of the mapping (as of the last grow or sync)."""
        self._check()
        return self._mapping.ptr

    @property
    def size(self) -> int:
        return self._mapping.size

    @property
    def reserved(self) -> int:
        """Address space reserved at ``ptr``: growth up to here never moves the pointer."""
        return self._mapping.reserved

    @property
    def closed(self) -> bool:
        return self._closed

    def _check(self) -> None:
        if self._closed:
            raise ClosedError(f"growable buffer {self.name!r} is closed")

    # -- following growth
    def grow(self, nbytes: int) -> Remap:
        """Grow to at least ``nbytes`` (rounded up to the granularity); a smaller size is a no-op."""
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise InvalidRequest(f"nbytes must be a positive int, got {nbytes!r}")
        self._check()
        return self._growables.grow(self, nbytes)

    def sync(self) -> Remap:
        """Map whatever other processes grew since the last call."""
        self._check()
        return self._growables.sync(self)

    def _stamped(self, reply: dict) -> None:
        """Mapped as of ``reply``: its stamp is the one a later sync compares the word with."""
        stamp = reply.get("stamp")
        self._stamp = stamp if isinstance(stamp, int) and not isinstance(stamp, bool) else None

    def _announce(self, gen: int, size: int, chunks: int) -> None:
        if gen > self._announced[0]:
            self._announced = (gen, size, chunks)

    def _map_to(self, gen: int, size: int, nchunks: int, fetch: _Fetch) -> Remap:
        """Map until ``size`` bytes (``nchunks`` chunks) are mapped: from what this process holds
        where the backend can, else from the FDs ``fetch(first)`` gives with their chunks' sizes."""
        old_ptr, old_size, moved = self._mapping.ptr, self._mapping.size, False
        if self._mapping.size:
            # The host maps its memfd as long as it is now: a grow another process was answered
            # for is seen even before its notice arrives. (Its chunk count then only feeds the
            # ``first`` of a later request, whose FDs the host does not need: it follows again.)
            local = self._mapping.follow(size)
            if local is not None:
                moved, self._chunks = local, max(self._chunks, nchunks)
        while self._mapping.size < size:
            chunks, fds = fetch(self._chunks)
            if not chunks:
                for fd in fds:
                    os.close(fd)
                raise InvalidRequest(f"growable buffer {self.name!r}: the broker sent no chunks")
            moved |= self._mapping.extend(chunks, fds)
            self._chunks += len(chunks)
        self.generation = max(self.generation, gen)
        moved = moved and old_ptr != 0
        return Remap(self._mapping.size > old_size, moved, self._mapping.ptr, self._mapping.size, old_ptr)

    # -- access
    def view(self) -> memoryview:
        """The bytes, on the host backend (after a sync)."""
        self.sync()
        view = self._mapping.view()
        if view is None:
            raise InvalidRequest("view() is for host memory; on CUDA use ptr, CAI or DLPack")
        return view

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        if self.device < 0:
            raise AttributeError("host memory has no __cuda_array_interface__")
        self.sync()
        return {"version": 3, "shape": (self.size,), "typestr": "|u1", "data": (self.ptr, False),
                "strides": None, "stream": None}

    # -- lifetime
    def close(self) -> None:
        """Unmap (CUDA: after this device's work has finished) and detach."""
        if self._closed:
            return
        self._closed = True
        self._growables.detach(self)

    def delete(self) -> None:
        """Delete the name; the memory goes once every attached process has closed it."""
        self._growables.delete(self.name)

    def __enter__(self) -> GrowableBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"ptr=0x{self._mapping.ptr:x} size={self.size}"
        return f"<GrowableBuffer {self.name!r} {state} gen={self.generation}>"
