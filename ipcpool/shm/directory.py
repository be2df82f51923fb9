"""The name directory: per pool, where each live named object lies, written only by the broker.

A reader that finds a name here needs no reply to read the object: the entry says where its bytes
are (an allocation the reader imports once, an offset, a size), whether it is sealed, and, while it
is being written, the seal-board word and number its writer will post and the IPC event the seal
is recorded on. The broker writes an entry as the first thing it does with a create it accepts, and
changes it at the seal, the delete and the abort; the broker stays the authority for everything
else (metadata beyond dtype and shape, listing, quotas).

Layout (little-endian): a header entry, then ``capacity`` entries of ``ENTRY`` bytes. A name's home
is ``crc32(name) % capacity``; collisions probe linearly (at most ``MAX_PROBE``); a gone entry is a
tombstone that lookups pass and inserts reuse. Each entry is a seqlock: ``ver`` is odd while the
broker writes it, so a reader copies it between two equal even reads (stores and loads keep their
order on x86 and are fenced by the interpreter's calls elsewhere). ``change`` in the header counts
every write, so a reader waiting for a name spins on one word (and sleeps on it: ``shm.futex``);
``awake`` (at 64) is when the broker stops busy-polling (``shm.requests``). ``gen`` is the
object's number, never reused: a reader's hazard slot (``shm.leases``) names (entry, gen).

The memfd is sealed read-only for everyone but the broker's own mapping (``shm.sealing``); only a
pool's clients get it, so a directory says nothing to anyone outside its trust boundary.

``_native.c`` reads and writes this same layout in C (a reader's lookup and state check, the
broker's publish), where the package was built with it: a change here is a change there, and
``tests/unit/test_directory_native.py`` holds the two to each other field for field.
"""

from __future__ import annotations

import mmap
import struct
import zlib
from typing import NamedTuple

from . import futex, sealing

try:   # a reader's lookup and state check, the broker's publish, in C (``_native.c``) where built
    from ._native import lookup as _native_lookup, publish as _native_publish, state as _native_state
except ImportError:   # the same in Python: ``DirectoryView.lookup`` and ``state``, ``Directory.publish``
    _native_lookup = _native_publish = _native_state = None

ENTRY = 512
CAPACITY = 8192          # entries per pool: 4 MiB of address space, pages backed as used
MAX_CAPACITY = 1 << 20
MAX_PROBE = 64           # past this many taken slots a name gets no entry (readers ask the broker)
TORN_READS = 1000        # a lookup reading entries the broker is writing gives up after this many
TORN_US = 300            # ... the C lookup after this long (about what TORN_READS take in Python)
MAX_NAME = 255
MAX_DIMS = 8             # more dimensions: no shape here (the reader asks the broker for metadata)
NO_WORD = 0xFFFFFFFF
MAGIC = 0x31524944504F4350   # "PCOPDIR1"

EMPTY, WRITING, SEALED, GONE = 0, 1, 2, 3

# ver, gen, state, name_len, alloc, offset, size, word, ndim, dtype_len, flags, seq, event
_HEAD = struct.Struct("<QQIIQQQIBBHQ64s")
_DTYPE_AT, _SHAPE_AT, _NAME_AT = 128, 160, 224
# All of an entry after ``ver``, as the broker writes it: the head's other fields, then the dtype,
# the shape (MAX_DIMS dims) and the name, each at its place above.
_BODY = struct.Struct("<QIIQQQIBBHQ64s32s64s255s")
assert 8 + _BODY.size == _NAME_AT + MAX_NAME and _HEAD.format[2:] in _BODY.format
_HEADER = struct.Struct("<QQQ")   # magic, capacity, change
_CHANGE_AT = 16
_AWAKE_AT = 64   # the broker polls without sleeping until then (CLOCK_MONOTONIC ns: ``shm.requests``)
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
HAS_USER_META = 1       # flags: the object carries more metadata than dtype and shape
HAS_SHAPE = 2           # flags: ``shape`` holds the object's shape (else it has none here)
IN_ARENA = 4            # flags: ``alloc`` is an arena the object was carved from (else its own)
KEPT_EVENT = 8          # flags: ``event`` is one of the broker's credits, never destroyed while it
                        # lives (``backend.cuda.events.CreditStock``): a reader may keep it open
_FLAGS_AT = 54
_U16 = struct.Struct("<H")
_body_into = _BODY.pack_into   # (publish's, bound once)
_NO_EVENT = bytes(64)
_new = tuple.__new__   # (an Entry without its generated ``__new__``, a Python call)
_DIMS = [struct.Struct(f"<{n}Q") for n in range(MAX_DIMS + 1)]   # a shape's layout, by its ndim


class Entry(NamedTuple):   # (a tuple: made on every lookup, where a frozen dataclass costs ~3 µs)
    index: int
    gen: int
    state: int
    alloc: int
    offset: int
    size: int
    word: int | None
    seq: int
    event: bytes
    dtype: str | None
    shape: tuple[int, ...] | None
    has_user_meta: bool
    in_arena: bool
    kept_event: bool = False


_WHERE = struct.Struct("<QQQBBB")


def where_key(alloc: int, offset: int, size: int, dtype: str | None, shape: tuple[int, ...] | None) -> bytes:
    """Where an object lies and how it is typed, as the broker writes it in its entry (``_typed``)
    and ``_native.c``'s ``take`` compares an entry to a reader's lease made ahead: arena, offset and
    size, ndim (0 without a shape), dtype length, whether it has a shape, dtype, dims."""
    dt = dtype.encode()[:32] if dtype else b""
    dims = b"" if shape is None else _DIMS[len(shape)].pack(*shape)
    return _WHERE.pack(alloc, offset, size, 0 if shape is None else len(shape), len(dt), shape is not None) + dt + dims


def _length(capacity: int) -> int:
    return -(-(capacity + 1) * ENTRY // mmap.PAGESIZE) * mmap.PAGESIZE


def home(name: bytes, capacity: int) -> int:
    return zlib.crc32(name) % capacity


def _typed(dtype: str | None, shape: list[int] | None, has_user_meta: bool, in_arena: bool,
           kept_event: bool) -> tuple[bytes, bytes, int, int]:
    """An entry's dtype and shape as written (dtype, dims, ndim), and its flags."""
    flags = (IN_ARENA if in_arena else 0) | (KEPT_EVENT if kept_event else 0) | (HAS_USER_META if has_user_meta else 0)
    dt = dims = b""
    ndim = 0
    if dtype:
        dt = dtype.encode()[:32]
    if shape is not None:
        if len(shape) <= MAX_DIMS:
            ndim = len(shape)
            flags |= HAS_SHAPE
            dims = struct.pack(f"<{ndim}Q", *shape) if ndim else b""
        else:   # (too many dimensions for the entry: the reader asks the broker)
            flags |= HAS_USER_META
    return dt, dims, ndim, flags


class Directory(sealing.Owned):
    """The broker's mapping: every write. Only the event loop calls it (single writer)."""

    def __init__(self, pool_name: str, capacity: int = CAPACITY):
        if not 0 < capacity <= MAX_CAPACITY:
            raise ValueError(f"a name directory has 1 to {MAX_CAPACITY} entries, not {capacity}")
        self.capacity = capacity
        self.length = _length(capacity)
        self.fd, self._map = sealing.create(f"ipcpool-directory:{pool_name}", self.length, sealing.READ_ONLY)
        sealing.populate(self._map, write=True)   # (its pages, backed now: 4 MiB at the default capacity)
        _HEADER.pack_into(self._map, 0, MAGIC, capacity, 0)
        self._words = sealing.words(self._map)   # versions, the change count, the awake moment
        self.probes = min(MAX_PROBE, capacity)
        self._taken: dict[int, bytes] = {}   # index -> name, for live entries (WRITING, SEALED)
        self._tombs: set[int] = set()        # gone entries a probe must pass (see ``_trim``)
        self._sleepers_at = futex.address(self._map, _CHANGE_AT) if futex.usable else 0

    def _at(self, index: int) -> int:
        return (index + 1) * ENTRY

    def _bump(self, at: int) -> int:
        words = self._words
        ver = words[at // 8] + 1
        words[at // 8] = ver
        return ver

    def awake(self, until_ns: int) -> None:
        """The broker busy-polls (and reads the request rings) until ``until_ns`` at least."""
        self._words[_AWAKE_AT // 8] = until_ns

    def _changed(self) -> None:
        self._words[_CHANGE_AT // 8] += 1   # (the broker's word alone: C and Python both count here)

    def wake_sleepers(self) -> None:
        """Wake the readers asleep on the change count (``DirectoryView.sleep``), after a change
        one of them asked to be woken for."""
        if self._sleepers_at and self._map is not None:
            futex.wake(self._sleepers_at)

    def publish(self, name: str, gen: int, state: int, alloc: int, offset: int, size: int,
                word: int | None, seq: int, event: bytes, dtype: str | None,
                shape: list[int] | None, has_user_meta: bool, in_arena: bool, kept_event: bool = False) -> int | None:
        """A new live entry for ``name`` (no live entry of it may exist); its index, or None
        where its probe found no free slot. In C where the package has it (``_native.c``: the
        entry a reader waits for, on the create's path), else ``_publish_py``."""
        raw = name.encode()
        if _native_publish is None:
            return self._publish_py(raw, gen, state, alloc, offset, size, word, seq, event, dtype, shape,
                                    has_user_meta, in_arena, kept_event)
        dt, dims, ndim, flags = _typed(dtype, shape, has_user_meta, in_arena, kept_event)
        index = _native_publish(self._map, self.capacity, self.probes, raw, gen, state, alloc, offset, size,
                                NO_WORD if word is None else word, seq, event, dt, dims, ndim, flags)
        if index is not None:
            self.written(index, raw)
        return index

    def written(self, index: int, raw: bytes) -> None:
        """Entry ``index`` now holds live name ``raw`` (written by ``publish``, or in C by the broker's
        check of a usual create: ``_native.usual_create``)."""
        self._taken[index] = raw
        self._tombs.discard(index)

    @property
    def mapping(self) -> mmap.mmap:
        """The writable map (C writes entries there: ``written`` then keeps the books)."""
        return self._map

    def _publish_py(self, raw: bytes, gen: int, state: int, alloc: int, offset: int, size: int,
                    word: int | None, seq: int, event: bytes, dtype: str | None,
                    shape: list[int] | None, has_user_meta: bool, in_arena: bool, kept_event: bool) -> int | None:
        """``publish`` in Python."""
        cap = self.capacity
        index = home(raw, cap)
        taken = self._taken
        if index in taken:
            start = index
            for k in range(1, self.probes):
                index = (start + k) % cap
                if index not in taken:
                    break
            else:
                return None
        dt, dims, ndim, flags = _typed(dtype, shape, has_user_meta, in_arena, kept_event)
        words = self._words
        ver_at = (index + 1) * (ENTRY // 8)
        ver = words[ver_at] + 1
        words[ver_at] = ver   # odd: readers skip it while it changes
        # The rest of the entry in one write (struct pads a short event, dtype, shape and name with zeros).
        _body_into(self._map, ver_at * 8 + 8, gen, state, len(raw), alloc, offset, size,
                   NO_WORD if word is None else word, ndim, len(dt), flags, seq, event, dt, dims, raw)
        words[ver_at] = ver + 1   # even: whole
        self.written(index, raw)
        self._changed()
        return index

    def close(self) -> None:
        if self._words is not None:
            self._words.release()   # (the map will not close while a view of it lives)
            self._words = None
        super().close()

    def set_state(self, index: int, gen: int, state: int, *, event: bytes | None = None) -> None:
        """The entry of object ``gen`` is now ``state`` (SEALED, or GONE: a tombstone); a new
        ``event`` is not one to keep open (``KEPT_EVENT`` goes)."""
        at = self._at(index)
        if _U64.unpack_from(self._map, at + 8)[0] != gen:
            return
        self._bump(at)
        _U32.pack_into(self._map, at + 16, state)
        if event is not None:
            self._map[at + 64: at + 128] = event.ljust(64, b"\0")[:64]
            _U16.pack_into(self._map, at + _FLAGS_AT, _U16.unpack_from(self._map, at + _FLAGS_AT)[0] & ~KEPT_EVENT)
        self._bump(at)
        if state == GONE:
            self._taken.pop(index, None)
            self._tombs.add(index)
            self._trim(index)
        self._changed()

    def _trim(self, index: int) -> None:
        """Gone entries just before an empty one become empty again: a lookup of a missing name
        stops at the first empty entry, and a table of tombstones would make every miss probe
        MAX_PROBE entries (~25 µs). No live entry lies past an empty one on its probe (an insert
        takes the first free entry from home, and a run is emptied only from its end), so no
        lookup loses its name. The gen goes too: a reader's hazard on it reads GONE."""
        cap = self.capacity
        if (index + 1) % cap in self._taken or (index + 1) % cap in self._tombs:
            return
        while index in self._tombs:
            at = self._at(index)
            self._bump(at)
            _U64.pack_into(self._map, at + 8, 0)
            _U32.pack_into(self._map, at + 16, EMPTY)
            self._bump(at)
            self._tombs.discard(index)
            index = (index - 1) % cap



class DirectoryView:
    """A client's read-only mapping of a pool's directory."""

    def __init__(self, fd: int, capacity: int):
        self.capacity = capacity
        self._map = sealing.map_received(fd, _length(capacity), sealing.READ_ONLY, "a name directory",
                                         writable=False)
        magic, cap, _ = _HEADER.unpack_from(self._map, 0)
        if magic != MAGIC or cap != capacity:
            self._map.close()
            raise ValueError("a name directory whose header does not match")
        self._words = sealing.words(self._map)
        self.probes = min(MAX_PROBE, capacity)
        self._change_at = futex.address(self._map, _CHANGE_AT) if futex.usable else 0
        # The read-only map, as C takes it (the reader's ``take``, the ring's put reads ``awake_until``
        # there), pinned: an attribute, where a property is a call more on a hand-off's path.
        self.mapping: object = sealing.pinned(self._map)

    def populate(self) -> None:
        """Map every page now (``sealing.populate``), not at a look's first touch of it: ~0.4 ms
        for the default 4 MiB on a 2-CPU host, which the pool's import does not pay (a worker
        attaching its weights never reads the directory); its readers do it off a get's path."""
        sealing.populate(self._map, write=False)

    def change(self) -> int:
        return self._words[_CHANGE_AT // 8]

    def sleep(self, seen: int, timeout_s: float) -> bool:
        """Until the change count moves from ``seen`` (read before the caller last looked) and the
        broker wakes its sleepers, at most ``timeout_s``; at once where it moved already. False
        where the kernel cannot sleep on this mapping (the caller sleeps on its socket instead)."""
        return futex.wait(self._change_at, seen, timeout_s)

    def awake_until(self) -> int:
        return self._words[_AWAKE_AT // 8]

    def lookup(self, name: str) -> Entry | None:
        """The live entry of ``name`` (WRITING or SEALED), or None. A reader's get runs it first,
        often on a CPU whose caches its sleep left cold: in C where the package has it (a third
        of the Python's time, warm), else ``lookup_py``. An entry read while the broker writes it
        is read again (up to TORN_READS in all, or TORN_US in C, then None: the caller looks again
        or asks the broker)."""
        if _native_lookup is not None:
            got = _native_lookup(self.mapping, self.capacity, self.probes, name.encode(), TORN_US)
            return None if got is None else _new(Entry, got)
        return self.lookup_py(name)

    def lookup_py(self, name: str) -> Entry | None:
        """``lookup`` in Python: one function, no calls of ours and no iterator per probe."""
        raw = name.encode()
        n = len(raw)
        cap = self.capacity
        index = zlib.crc32(raw) % cap   # (``home``)
        m, words, head_of = self._map, self._words, _HEAD.unpack_from
        probes, torn = self.probes, 0
        while probes:
            at = (index + 1) * ENTRY
            w = at >> 3
            ver = words[w]
            if not ver & 1:
                (_, gen, state, name_len, alloc, offset, size, word, ndim, dtype_len, flags, seq,
                 event) = head_of(m, at)
                if state == EMPTY:
                    if words[w] == ver:
                        return None
                elif (name_len == n and (state == WRITING or state == SEALED)
                        and m[at + _NAME_AT: at + _NAME_AT + n] == raw):
                    entry = _new(Entry, (
                        index, gen, state, alloc, offset, size, None if word == NO_WORD else word, seq,
                        b"" if event == _NO_EVENT else event,
                        bytes(m[at + _DTYPE_AT: at + _DTYPE_AT + dtype_len]).decode() if dtype_len else None,
                        _DIMS[ndim].unpack_from(m, at + _SHAPE_AT) if flags & HAS_SHAPE and ndim <= MAX_DIMS else None,
                        flags & HAS_USER_META != 0, flags & IN_ARENA != 0, flags & KEPT_EVENT != 0))
                    if words[w] == ver:
                        return entry
                elif words[w] == ver:   # another name's entry, whole: the next on the probe
                    probes -= 1
                    index = index + 1 if index + 1 < cap else 0
                    continue
            torn += 1   # being written: this entry again
            if torn >= TORN_READS:
                return None
        return None

    def state(self, index: int, gen: int) -> int:
        """The state of entry ``index`` while it still holds object ``gen``; GONE once it does not."""
        if _native_state is not None:
            got = _native_state(self.mapping, index, gen)
            if got is not None:   # (None: written all this while; waited for below, interruptibly)
                return got
        return self.state_py(index, gen)

    def state_py(self, index: int, gen: int) -> int:
        """``state`` in Python."""
        at = (index + 1) * ENTRY
        m, words, w = self._map, self._words, at // 8
        while True:
            ver = words[w]
            if ver & 1:
                continue
            g, state = words[w + 1], _U32.unpack_from(m, at + 16)[0]
            if words[w] == ver:
                return state if g == gen else GONE

    def close(self) -> None:
        if self._map is not None:
            sealing.unpin(self.mapping)
            self._words.release()
            self._map.close()
            self._map = self.mapping = None
