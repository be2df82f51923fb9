"""The seal board: one page-backed memfd per pool where a writer says "sealed" without a message.

Each arena the broker hands out gets a block of ``BLOCK`` 64-bit words of its pool's board. A client
that carves an object gives it a word of its arena's block and a sequence number (both named in
its ``create``); after recording its seal it stores that number in the word. A reader the broker
already told about the object (a ``get`` answered as *pending*) spins on the word until it holds
that number, so the seal reaches it without a hop. The client reuses a word once the object that
had it was sealed or given up, and numbers only grow: a reader, or the broker, takes only the very
number as that object's seal. "At least" would take a given-up object's for sealed once its word
served a later one (its writer does not wait for the broker to have the abort); a reader that
sees a later number (it looked late) learns of the seal from the directory or the broker.

The board travels with the pool's FD on the control socket and every client of the pool may write
it: it is trusted only as far as the pool's clients are (they can write the pool's memory too). A
reader checks the word's index against the board's bounds, and the broker stays the authority: it
still receives every seal, and tells a pending reader of it (or of an abort) over ZeroMQ, so a
garbled word can make a reader wait for that notice, never wait forever or read outside the pool.

A reader whose spin runs out before the seal sleeps on the object's word (``sleep``, a futex) and
the writer's post wakes it, with no request and no broker on the way; the broker wakes it too
where the object is aborted (or sealed without a post). A sleeper says so first in the board's
last page (``sleepers``: until when some reader may sleep, monotonic ns), so a writer makes the
wake's system call only then. Sleeps last at most ``futex.SLICE_S``: a wake lost to a race
costs time, never correctness.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time

from ..errors import InvalidRequest, OutOfMemory
from ..ranges import RangeAllocator
from . import futex, sealing

try:   # a seal's record and post in one call (``_native.c``) where built; a reader's query of it
    from ._native import event_query, record_post as _native_record_post
except ImportError:
    _native_record_post = event_query = None

WORD = 8
BLOCK = 256            # words per arena: the unsealed objects one arena can have on the board
WORDS = 1 << 16        # words per pool: 256 arenas at once; an arena beyond that gets no block
_SLEEPERS_AT = WORDS * WORD   # then a page whose first word is ``sleepers``
BYTES = _SLEEPERS_AT + mmap.PAGESIZE   # 512 KiB and a page of address space; only pages used are backed
FIRST_MAX = 1 << 62     # an arena's first number stays below this (a client's 64-bit count never reaches it)
_SLEEP_MARGIN_NS = 1_000_000   # a sleeper says it sleeps this much longer than it asks (its slice may overrun)


class Board:
    """A mapping of a pool's board (the broker's or a client's)."""

    def __init__(self, fd: int, *, owner: bool):
        try:
            if owner:
                os.ftruncate(fd, BYTES)
            elif os.fstat(fd).st_size != BYTES:
                raise InvalidRequest(f"a seal board is {BYTES} bytes, got {os.fstat(fd).st_size}")
            self._map = mmap.mmap(fd, BYTES)
        finally:
            if not owner:
                os.close(fd)   # the mapping holds the memory
        self.fd = fd if owner else -1
        self._words = (ctypes.c_uint64 * WORDS).from_buffer(self._map)
        self._sleepers = ctypes.c_uint64.from_buffer(self._map, _SLEEPERS_AT)
        self._base = ctypes.addressof(self._words) if futex.usable else 0   # (0: no sleeping here)
        self.mapping = sealing.pinned(self._map, writable=True)   # (as a seal in one C call takes it: ``requests.put_sealed``)

    @classmethod
    def create(cls, name: str) -> Board:
        fd = os.memfd_create(f"ipcpool-board:{name}", os.MFD_CLOEXEC)
        try:
            return cls(fd, owner=True)
        except BaseException:
            os.close(fd)
            raise

    def post(self, index: int, seq: int) -> None:
        """The object at word ``index`` is sealed (one aligned 8-byte store), and a reader asleep
        on the word woken (a system call only while some reader may sleep on this board)."""
        self._words[index] = seq
        if self._sleepers.value:
            self.wake(index)

    def post_after(self, event: int, stream: int, index: int, seq: int) -> int | None:
        """``post``, once ``event`` (a CUevent, as an int) is recorded on ``stream`` (a CUstream),
        in one C call (``_native.c``), the record first, as R1 needs: 0 done; a CUresult where the
        record failed (nothing posted); None where it cannot be done so here (no C part, no CUDA
        driver loaded in this process)."""
        if _native_record_post is None:
            return None
        got = _native_record_post(event, stream, self.mapping, index, seq)
        if got == -1:
            return None
        if got == -2:   # posted; a reader may sleep on this board
            self.wake(index)
            return 0
        return got

    def wake(self, index: int) -> None:
        """Wake the readers asleep on word ``index``, where some reader may sleep on this board."""
        if self.sleeping and 0 <= index < WORDS:
            futex.wake(self._base + index * WORD)

    @property
    def sleeps(self) -> bool:
        """Whether a reader can sleep on a word here (``sleep``)."""
        return self._base != 0

    @property
    def sleeping(self) -> bool:
        """Whether some reader may be asleep on a word of this board now."""
        return self._base != 0 and self._sleepers.value > time.monotonic_ns()

    def sleep(self, index: int, seen: int, timeout_s: float) -> bool:
        """Sleep while word ``index`` still holds ``seen``, at most ``timeout_s`` (no longer than
        ``futex.SLICE_S`` is asked for: the caller looks again after each); False where it could
        not sleep (the caller sleeps some other way)."""
        if not self._base or not 0 <= index < WORDS:
            return False
        until = time.monotonic_ns() + int(timeout_s * 1e9) + _SLEEP_MARGIN_NS
        if self._sleepers.value < until:   # (said before the word is read again: see the module's doc)
            self._sleepers.value = until
        if self._words[index] != seen:
            return True
        return futex.wait(self._base + index * WORD, seen, timeout_s)

    def read(self, index: int) -> int:
        return self._words[index] if 0 <= index < WORDS else 0

    def clear(self, base: int, count: int) -> None:
        """Zero a block before it serves another arena (its numbers start again at 1)."""
        ctypes.memset(ctypes.addressof(self._words) + base * WORD, 0, count * WORD)

    def close(self) -> None:
        if self._words is not None:
            self._words = self._sleepers = None
            self._base = 0
            sealing.unpin(self.mapping)
            self._map.close()
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1


class Blocks:
    """The broker's share-out of its board for one pool: a block of words per arena, or none.

    A block serves arena after arena. Each next arena numbers its objects on from past every number
    an arena before it gave out there (``take``'s first number): a reader still watching a word for
    an object of a gone arena (asleep, or descheduled, as its writer died) then never sees that
    number again, where numbers starting again at 1 would soon post it for another object."""

    def __init__(self, board: Board) -> None:
        self.board = board
        self._free = RangeAllocator(WORDS, BLOCK)
        self._first: dict[int, int] = {}   # block -> the first number its next arena gives out

    def take(self) -> tuple[int, int] | None:
        """A block (its first word) and the first number its arena gives out; None: none left."""
        try:
            base = self._free.allocate(BLOCK)
        except OutOfMemory:   # full: that arena's readers hear of seals over ZeroMQ instead
            return None
        self.board.clear(base, BLOCK)
        return base, self._first.get(base, 1)

    def give_back(self, base: int, top: int) -> None:
        """``base``'s arena is done; ``top``: the highest number it gave out."""
        first = max(self._first.get(base, 1), top + 1)
        self._first[base] = first if first < FIRST_MAX else 1   # (the broker refuses numbers that high)
        self._free.free(base)
