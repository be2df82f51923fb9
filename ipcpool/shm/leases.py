"""A session's lease page: the hazard slots of the objects it reads straight from a directory.

Before a reader uses an object it found in a pool's directory it writes (pool, entry, gen, nonce)
into a free slot of its page, then checks the entry still holds object ``gen``. Before the broker
frees or reuses the memory of an object whose entry it marked gone, it runs the fence
(``shm.fence``) and reads every page of that pool's sessions: a slot naming the object becomes a
hold of that session's, which the reader's ``release`` (with its done event, R2) ends. So the broker
never reuses memory a reader that saw the entry may still read, whatever the timing.

The page is the session's own (a memfd the broker makes, sealed against shrinking so a client
cannot take the broker's mapping away): a client that writes garbage there can only make the broker
keep memory of its own pool a while longer, up to ``SLOTS`` objects, never read beyond the page.
A slot is free again only after the broker answered its release: until then its content is what
the broker's scan must see. The nonce is the slot's use count: a release names it, and the broker
ignores a slot whose nonce it has seen released.
"""

from __future__ import annotations

import functools
import mmap
import struct
from typing import Any

from . import directory, requests, sealing

try:   # a reader's lookup, hazard slot and check in one call (``_native.c``), where built
    from ._native import take as native_take
except ImportError:   # (``take`` after ``DirectoryView.lookup`` then)
    native_take = None

SLOTS = 120
SLOT = 32                 # pool, entry, gen, nonce, spare
HEAD = 64                 # a count of slots in use (the client's word: a hint, never trusted)
LENGTH = requests.AT + requests.LENGTH   # the hazard slots' page, then the session's request ring
_SLOTS = struct.Struct("<" + "IIQQ8x" * SLOTS)
_NONCE_AT = 16
# The count (word 0) and the nonces, as ``sealing.words``: a count read as 0 while it is written
# would make the broker skip the page and miss a slot taken long before.
_FIRST_WORD, _SLOT_WORDS = HEAD // 8, SLOT // 8   # a slot's pool and entry, then gen, then its nonce
_NONCE_WORD = _FIRST_WORD + _NONCE_AT // 8
assert HEAD + SLOTS * SLOT <= requests.AT == mmap.PAGESIZE
_new = tuple.__new__   # (an Entry without its generated ``__new__``)


class LeasePage(sealing.Owned):
    """The broker's side: make the page, read the live slots."""

    def __init__(self) -> None:
        self.fd, self._map = sealing.create("ipcpool-leases", LENGTH, sealing.FIXED_SIZE)
        self.released: dict[int, int] = {}   # slot -> the nonce whose release the broker has seen
        self.ring = requests.RingReader(self._map)
        self._words = sealing.words(self._map)   # (the count and nonces: see ``_NONCE_WORD``)

    def close(self) -> None:
        if self._map is not None:
            self.ring.close()
            self._words.release()
        super().close()

    def live(self) -> list[tuple[int, int, int, int, int]]:
        """(slot, pool, entry, gen, nonce) of every slot not released. A page whose count says
        none is in use is skipped (a client that lies about it only loses its own protection:
        it counts before it takes a slot). Nonces are read before the rest of their slots."""
        m, words = self._map, self._words
        if words[0] == 0:
            return []
        nonces = [words[_NONCE_WORD + s * _SLOT_WORDS] for s in range(SLOTS)]
        fields = _SLOTS.unpack_from(m, HEAD)
        released = self.released
        return [(s, fields[4 * s], fields[4 * s + 1], fields[4 * s + 2], n) for s, n in enumerate(nonces)
                if n and released.get(s) != n]



class ClientLeasePage:
    """A client's side: take a slot (write it), free it once its release was answered."""

    def __init__(self, fd: int):
        self._map = sealing.map_received(fd, LENGTH, sealing.FIXED_SIZE, "a lease page", writable=True)
        self._free = list(range(SLOTS - 1, -1, -1))
        self._nonces = bytearray(8)   # the last nonce given (the C take counts here too)
        self._pinned = sealing.pinned(self._map, writable=True)   # (as the C take and ring put take it)
        self.ring = requests.RingWriter(self._map, self._pinned)
        self._words = sealing.words(self._map)
        # The C take with this page bound: its lookup, slot and check in a call with no Python frame
        # around it (a get runs on a CPU its sleep left cold: a frame costs ~1 µs there). Its
        # arguments: (map, capacity, probes, name, pool, arenas, sealed_only[, made, credits]), its
        # answer as ``taken`` reads it. None where the C part is not built (``native_take``).
        self.take_in_c = None if native_take is None else functools.partial(
            native_take, self._pinned, self._free, self._nonces, directory.TORN_US)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def take(self, pool: int, entry: int, gen: int) -> tuple[int, int] | None:
        """(slot, nonce) now naming (pool, entry, gen), or None where every slot is in use."""
        if not self._free:
            return None
        slot = self._free.pop()
        nonce = int.from_bytes(self._nonces, "little") + 1
        self._nonces[:] = nonce.to_bytes(8, "little")
        words = self._words
        words[0] = SLOTS - len(self._free)
        # The nonce last: the broker reads it first, so a slot it counts is whole (TSO keeps the
        # order of these stores, and of its loads). Pool and entry are one word ("<II").
        at = slot * _SLOT_WORDS
        words[_FIRST_WORD + at] = pool | entry << 32
        words[_FIRST_WORD + at + 1] = gen
        words[_NONCE_WORD + at] = nonce
        return slot, nonce

    def give_back(self, slot: int) -> None:
        """The broker answered the slot's release: the slot is free (cleared: nonce 0)."""
        self._words[_NONCE_WORD + slot * _SLOT_WORDS] = 0
        self._free.append(slot)
        self._words[0] = SLOTS - len(self._free)

    def close(self) -> None:
        if self._map is not None:
            self.ring.close()
            self._words.release()
            sealing.unpin(self._pinned)
            self._map.close()
            self._map = None


def taken(got: tuple | None) -> tuple[Any, ...] | None:
    """``ClientLeasePage.take_in_c``'s answer read: the lookup, ``take`` and ``view.state`` in one C
    call, as a reader's get runs them on a CPU its sleep left cold. None: no entry. (entry, None):
    no slot taken, the caller decides (an entry the broker serves, an arena not in ``arenas``, not
    sealed where ``sealed_only``, no slot free). (entry, ((slot, nonce), state)): its slot taken,
    state None where the entry was being written all along. Where the object is sealed where one
    of ``made`` lies (keyed by ``directory.where_key``: the reader's leases made ahead) and its
    seal's event is done (a credit in ``credits``, the client's credit table, or none): (None,
    slot, nonce, index, gen, what ``made`` held, taken out of it) as the C gives it, no entry made."""
    if got is None or got[0] is None:
        return got
    entry = _new(directory.Entry, got[0])
    return (entry, None) if got[1] is None else (entry, ((got[1], got[2]), got[3]))
