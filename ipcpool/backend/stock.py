"""A stock of physical chunks made ahead of need, so that a grow hands out memory that exists.

Making a chunk is the slow part of a grow on CUDA (``cuMemCreate`` and its export: tens of
microseconds to milliseconds, growing with the size). The broker keeps some made, and a grow takes
from them before it makes any. Sizes are the granularity times powers of two, one chunk of each, as
many sizes as the target holds (1 GiB at 2 MiB: 2, 4, ..., 512 MiB), and a second chunk of the
granularity where the target has room for it: a buffer created at the granularity and doubled
takes that size twice, once for the create and once for its first step. Where the sizes stop at
the largest chunk the backend makes, not at the target, the rest of the target is more chunks of
that size (8 GiB with 2 GiB chunks: 2, 2, 4, ..., 1024 MiB and three of 2 GiB). A grow of up to the stock's
total is then the binary digits of its size: taken largest first while they fit, so the fewest
chunks and exactly the size asked (a grow never gets more than it asked for); what the stock lacks
is made at the time, as without a stock. A buffer grown by doubling takes one chunk per step.

Chunks may be lent to a session ahead of its grows (``lend``; see ``broker.loans``): a lent chunk
is still counted here (in ``bytes``, and as the chunk of its size, so that refill does not make it
again) until a grow uses it (``lent_used``) or the loan ends (``lent_back``, which releases it:
the borrower held its FD, so it is never lent or handed to anyone else).

Refill makes one chunk per call, the largest missing (or the largest missing up to a size), never
beyond the room it is given (the pool's max_size less what it holds). The broker calls it from its
idle pass, and right after answering a grow for one small chunk (see ``broker.growables``).
Backend-neutral: the backend gives ``make(size)`` and the chunks' ``close``; the host keeps no stock
(its chunk is a longer memfd, which costs about nothing to make when asked).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from ..sizes import round_up


class Chunk(Protocol):
    size: int

    def close(self) -> None: ...


C = TypeVar("C", bound=Chunk)


def stock_sizes(target: int, gran: int, largest: int) -> list[int]:
    """The chunk sizes a stock of ``target`` bytes holds, largest first: ``gran`` times powers of two,
    one of each, each at most ``largest``, all together at most ``target``."""
    sizes, size, total = [], gran, 0
    while gran > 0 and size <= largest and total + size <= target:
        sizes.append(size)
        total += size
        size *= 2
    return sizes[::-1]


class ChunkStock(Generic[C]):
    def __init__(self, target: int, gran: int, make: Callable[[int], C], largest: int,
                 release: Callable[[C], None] = lambda chunk: chunk.close()):
        self.gran = gran
        self.sizes = stock_sizes(target, gran, largest)
        self._make = make
        self._release = release
        self._held: dict[int, list[C]] = {size: [] for size in self.sizes}
        self._lent: dict[int, int] = {size: 0 for size in self.sizes}   # chunks of each size out on loan
        self._want: dict[int, int] = {size: 1 for size in self.sizes}   # chunks of each size to hold
        room = target - sum(self.sizes)
        if self.sizes and room >= gran:
            self._want[gran] += 1
            room -= gran
        if self.sizes and self.sizes[0] * 2 > largest:   # capped by the chunk, not by the target
            self._want[self.sizes[0]] += room // self.sizes[0]
        self.bytes = 0   # held now or lent: counted against the pool's max_size
        self.held = 0    # of which held now (not lent)

    def take(self, nbytes: int) -> tuple[list[C], int]:
        """Chunks for a grow of ``nbytes`` (rounded up to the granularity): stocked ones, largest
        first while they fit, and the bytes still lacking (for the caller to make)."""
        need = round_up(nbytes, self.gran)
        out: list[C] = []
        for size in self.sizes:
            held = self._held[size]
            while held and need >= size:
                out.append(held.pop())
                need -= size
                self.bytes -= size
                self.held -= size
        return out, need

    def give_back(self, chunks: list[C]) -> None:
        """Chunks taken for a grow that failed: back into the stock (or released, if not a size)."""
        for chunk in chunks:
            if chunk.size in self._held:
                self._held[chunk.size].append(chunk)
                self.bytes += chunk.size
                self.held += chunk.size
            else:
                self._release(chunk)

    def wanted(self, room: int, most: int | None = None) -> int | None:
        """The size to make next: the largest one missing that fits in ``room`` bytes (and is at
        most ``most``); None when there is none (full, or no room)."""
        for size in self.sizes:
            if len(self._held[size]) + self._lent[size] < self._want[size] and size <= room and (most is None or size <= most):
                return size
        return None

    def refill_one(self, room: int, most: int | None = None) -> bool:
        """Make one chunk (see ``wanted``); False when there was none to make. A failure to make
        it (the device is full) raises, and the stock is as it was."""
        size = self.wanted(room, most)
        if size is None:
            return False
        chunk = self._make(size)
        self._held[size].append(chunk)
        self.bytes += size
        self.held += size
        return True

    def lend(self, most: int, count: int) -> list[C]:
        """Up to ``most`` bytes (``count`` chunks) of the held chunks, smallest first (a burst that starts small
        needs those first), now lent: out of ``take``'s reach, and not made again."""
        out: list[C] = []
        for size in reversed(self.sizes):
            held = self._held[size]
            while held and size <= most and len(out) < count:
                out.append(held.pop())
                self._lent[size] += 1
                self.held -= size
                most -= size
        return out

    def lent_used(self, chunk: C) -> None:
        """A lent chunk became a buffer's: no longer the stock's (its size is made again)."""
        self._lent[chunk.size] -= 1
        self.bytes -= chunk.size

    def lent_back(self, chunks: list[C]) -> None:
        """Lent chunks no grow used, at the loan's end: released, never lent again."""
        for chunk in chunks:
            self._lent[chunk.size] -= 1
            self.bytes -= chunk.size
            self._release(chunk)

    def shed(self, room: int) -> int:
        """Release held chunks, smallest first, until at most ``room`` bytes are held (lent ones
        are the borrowers' to use): the stock yields to what a pool's buffers need. Returns the
        bytes released."""
        freed = 0
        if self.bytes <= room:   # (asked after every grow: most often it fits)
            return freed
        for size in reversed(self.sizes):
            held = self._held[size]
            while held and self.bytes > room:
                self._release(held.pop())
                self.bytes -= size
                self.held -= size
                freed += size
        return freed

    def close(self) -> None:
        self.shed(0)
