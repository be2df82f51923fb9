"""The growth board: one memfd of 64-bit words where the broker marks every grow of a growable.

Each growable buffer gets a word (``slots`` at most at once; one beyond gets none). The broker
stores a new stamp in it when it makes the buffer (a reused word never keeps an old stamp) and at
every grow, before it answers the grower or tells anyone; stamps come from one broker-wide count,
so a word never holds the same stamp twice. Each reply about the buffer (create, attach, grow,
grow_sync) names its word and the stamp it holds. A client whose mapping cannot see a grow by
itself (CUDA: each new chunk is an FD of its own) keeps the stamp of its last mapping; ``sync``
reads the word and asks the broker only when it changed. The grower is answered after the store,
so a process it then tells to use the new bytes reads the new stamp (an aligned 8-byte store to a
shared page, as the seal board's).

Only the broker writes. The memfd is sealed against any new writable mapping, write, shrink or
grow (F_SEAL_FUTURE_WRITE and friends) before its FD is handed out, once per session with the
first growable reply on the control socket; a client maps it read-only and uses it only when it
carries those seals. So no client can change what another reads, nor truncate the file under the
broker's mapping. A kernel without F_SEAL_FUTURE_WRITE (Linux < 5.1) gets no board: every sync asks.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os

from . import sealing

WORD = 8
SLOTS = 4096            # default count of words: growable buffers on the board at once
MAX_SLOTS = 1 << 20     # 8 MiB of address space at most; only pages whose words are used are backed
SEALS = sealing.READ_ONLY


def _length(slots: int) -> int:
    return -(-slots * WORD // mmap.PAGESIZE) * mmap.PAGESIZE


class GrowthBoard:
    """The broker's board: its words, who has which, and the stamp count."""

    def __init__(self, slots: int = SLOTS):
        if not 0 < slots <= MAX_SLOTS:
            raise ValueError(f"a growth board has 1 to {MAX_SLOTS} words, not {slots}")
        self.fd, self._map = sealing.create("ipcpool-growth-board", _length(slots), SEALS)   # writable here
        self._words = (ctypes.c_uint64 * slots).from_buffer(self._map)
        self.slots = slots
        self._free = list(range(slots - 1, -1, -1))   # pop() gives the lowest first
        self._stamp = 0

    def take(self) -> tuple[int, int]:
        """A word for a new buffer and its first stamp; (-1, 0) when every word is taken."""
        if not self._free:
            return -1, 0
        word = self._free.pop()
        return word, self.stamp(word)

    def stamp(self, word: int) -> int:
        """Mark a grow: a stamp this word never held (one aligned 8-byte store); returns it."""
        if not 0 <= word < self.slots:
            return 0
        self._stamp += 1
        self._words[word] = self._stamp
        return self._stamp

    def read(self, word: int) -> int:
        return self._words[word]

    def give_back(self, word: int) -> None:
        if 0 <= word < self.slots:
            self._free.append(word)

    def close(self) -> None:
        if self.fd >= 0:
            self._words = None
            self._map.close()
            os.close(self.fd)
            self.fd = -1


class BoardView:
    """A client's read-only mapping of the broker's board."""

    def __init__(self, mapping: mmap.mmap):
        self._map = mapping
        self._words = sealing.words(mapping)

    @classmethod
    def open(cls, fd: int) -> BoardView | None:
        """Map ``fd`` (owned: closed here) read-only; None where it is no sealed board."""
        try:
            size = os.fstat(fd).st_size
            if size <= 0 or size % mmap.PAGESIZE or size > _length(MAX_SLOTS):
                return None
            if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS:
                return None   # another process could write or shrink it: not to be trusted
            return cls(mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ))
        except OSError:
            return None
        finally:
            os.close(fd)

    def read(self, word: int) -> int | None:
        """The stamp in ``word``; None for a word outside the board (or once closed)."""
        words = self._words
        return words[word] if words is not None and 0 <= word < len(words) else None

    def close(self) -> None:
        if self._words is not None:
            self._words.release()
            self._words = None
            self._map.close()
