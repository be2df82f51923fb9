"""The directory reader's C lookup (``ipcpool/shm/_native.c``) against the Python one it stands in
for: the same entry, field for field, on a real directory; never an entry torn by the broker's
writes, read from another process while the broker rewrites it; a clear error for a bad call."""

import os
import struct
import subprocess
import sys
import textwrap
import time
import zlib

import pytest

from ipcpool.shm import directory as layout

native = pytest.importorskip("ipcpool.shm._native", reason="not built here (no C compiler when installed)")


def _fields(gen: int) -> dict:
    """An entry whose every field is a function of ``gen``: a mix of two writes shows."""
    return {"alloc": gen * 11, "offset": gen * 5, "size": gen * 3, "word": None if gen % 4 == 0 else gen % 1000,
            "seq": gen * 7, "event": b"" if gen % 3 == 0 else bytes([gen % 251 + 1]) * 64,
            "dtype": ("float16", "bfloat16", None)[gen % 3], "shape": None if gen % 5 == 0 else [gen % 9 + 1] * (gen % 4),
            "has_user_meta": gen % 6 == 0, "in_arena": gen % 7 != 0, "kept_event": gen % 2 == 0}


def _publish(d: layout.Directory, name: str, gen: int, state: int = layout.WRITING) -> int:
    f = _fields(gen)
    return d.publish(name, gen, state, f["alloc"], f["offset"], f["size"], f["word"], f["seq"], f["event"],
                     f["dtype"], f["shape"], f["has_user_meta"], f["in_arena"], f["kept_event"])


def _whole(entry: layout.Entry) -> bool:
    f = _fields(entry.gen)
    return (entry.alloc, entry.offset, entry.size, entry.word, entry.seq, entry.event, entry.dtype,
            entry.shape, entry.has_user_meta, entry.in_arena, entry.kept_event) == (
        f["alloc"], f["offset"], f["size"], f["word"], f["seq"], f["event"], f["dtype"],
        None if f["shape"] is None else tuple(f["shape"]), f["has_user_meta"], f["in_arena"], f["kept_event"])


def test_the_c_lookup_reads_every_entry_as_the_python_one_does():
    """Two thousand entries of every kind (sealed or being written, with and without a shape, a
    dtype, an event, a word), a seventh of them gone, names that probe past others, names that
    are missing: both lookups give the same Entry, and ``state`` the same state."""
    d = layout.Directory("t", 4096)
    view = layout.DirectoryView(os.dup(d.fd), d.capacity)
    names = [f"obj/{i}" for i in range(1, 2001)]
    for gen, name in enumerate(names, 1):
        _publish(d, name, gen, layout.SEALED if gen % 2 else layout.WRITING)
    for name in names[::7]:
        e = view.lookup_py(name)
        d.set_state(e.index, e.gen, layout.GONE)
    found = 0
    for name in names + [f"missing/{i}" for i in range(300)] + ["x" * 255, "é/ü"]:
        want = view.lookup_py(name)
        got = native.lookup(view._map, view.capacity, view.probes, name.encode(), layout.TORN_US)
        assert (None if got is None else layout.Entry(*got)) == want, name
        if want is not None:
            found += 1
            assert _whole(want)
            assert native.state(view._map, want.index, want.gen) == view.state_py(want.index, want.gen) == want.state
            assert native.state(view._map, want.index, want.gen + 1) == layout.GONE
    assert found == 2000 - len(names[::7])
    view.close()
    d.close()


def test_the_c_home_of_a_name_is_zlibs():
    for data in (b"", b"a", b"h/123", "é".encode() * 40, bytes(range(256))):
        assert native.crc32(data) == zlib.crc32(data)


def test_an_entry_mid_write_is_waited_for_as_long_as_the_python_lookup_would_then_given_up_on():
    """The C reads an entry being written again for TORN_US (the Python's TORN_READS reads take
    about that), not for TORN_READS of its own far faster reads: a broker's write outlasts those."""
    d = layout.Directory("t", 8)
    view = layout.DirectoryView(os.dup(d.fd), d.capacity)
    index = _publish(d, "x", 1)
    d._words[(index + 1) * layout.ENTRY // 8] += 1   # mid-write
    began = time.perf_counter()
    assert native.lookup(view._map, view.capacity, view.probes, b"x", layout.TORN_US) is None
    assert time.perf_counter() - began >= layout.TORN_US / 1e6
    d._words[(index + 1) * layout.ENTRY // 8] += 1   # whole
    assert native.lookup(view._map, view.capacity, view.probes, b"x", layout.TORN_US)[1] == 1
    view.close()
    d.close()


def test_a_bad_call_is_an_error_not_a_read_past_the_map():
    d = layout.Directory("t", 8)
    view = layout.DirectoryView(os.dup(d.fd), d.capacity)
    with pytest.raises(ValueError, match="capacity beyond its map"):
        native.lookup(view._map, 1 << 20, 8, b"a", 10)
    with pytest.raises(IndexError, match="no such directory entry"):
        native.state(view._map, 1 << 20, 1)
    with pytest.raises(TypeError):
        native.lookup(view._map, 8, 8, "a str, not bytes", 10)
    view.close()
    d.close()


_READER = textwrap.dedent("""
    import sys, time
    from ipcpool.shm import directory as layout
    fd, capacity, kind = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    if kind == "python":
        layout._native_lookup = layout._native_state = None
    sys.path.insert(0, sys.argv[4])
    from test_directory_native import _whole
    view = layout.DirectoryView(fd, capacity)
    print("ready", flush=True)
    seen = torn = 0
    until = time.monotonic() + 3
    while seen < 5000 and time.monotonic() < until:
        entry = view.lookup("x")
        if entry is not None:
            seen += 1
            torn += not _whole(entry) or view.state(entry.index, entry.gen) not in (layout.WRITING, layout.SEALED,
                                                                                   layout.GONE)
    print(seen, torn, flush=True)
""")


def _rewrite_slowly(d: layout.Directory, index: int, gen: int) -> None:
    """Entry ``index`` (object ``gen``) written again as the broker writes, but slowly: its version
    odd, its size wrong for ~20 µs, then right, then the version even (and it stays whole ~20 µs)."""
    at = (index + 1) * layout.ENTRY
    d._words[at // 8] += 1
    struct.pack_into("<Q", d._map, at + 40, 0xBAD)
    _hold(20e-6)
    struct.pack_into("<Q", d._map, at + 40, _fields(gen)["size"])
    d._words[at // 8] += 1
    _hold(20e-6)   # (whole a while: a reader finds it now and then)


def _hold(seconds: float) -> None:
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


@pytest.mark.parametrize("kind", ["native", "python"])
def test_a_reader_in_another_process_never_sees_an_entry_the_broker_is_rewriting(kind):
    """The broker writes one name's entry again and again, each time with other values in every
    field, and rewrites it in place slowly (a broker stopped mid-write); a reader process looks it
    up as fast as it can: every entry it gets is one whole write (the seqlock), for the C lookup
    as for the Python one. (It fails with the C lookup's version check taken out.)"""
    d = layout.Directory("t", 8)
    with subprocess.Popen([sys.executable, "-c", _READER, str(d.fd), str(d.capacity), kind,
                           os.path.dirname(__file__)], pass_fds=(d.fd,), stdout=subprocess.PIPE, text=True) as reader:
        try:
            assert reader.stdout.readline().strip() == "ready"
            gen = 0
            while reader.poll() is None:
                gen += 1
                index = _publish(d, "x", gen, layout.SEALED)
                for _ in range(10):   # then in place, as a broker stopped mid-write: its size wrong a while
                    _rewrite_slowly(d, index, gen)
                d.set_state(index, gen, layout.GONE)
            seen, torn = map(int, reader.stdout.read().split())
        finally:
            reader.kill()
            d.close()
    assert reader.returncode == 0
    assert seen > 200, f"the reader found the entry only {seen} times in {gen} writes"
    assert torn == 0, f"{torn} of {seen} entries read were torn"


def test_the_c_publish_writes_every_byte_the_python_one_does():
    """The broker's publish both ways, on two directories, the same calls (names that share homes,
    entries gone between, every kind of field, a probe that finds no room): the same indexes and,
    byte for byte, the same maps, change count included."""
    maps = []
    for kind in ("native", "python"):
        d = layout.Directory("t", 64)
        publish = native.publish if kind == "native" else None
        indexes = []
        for gen in range(1, 400):
            name = f"w/{gen % 97}"
            if publish is None:
                index = d._publish_py(name.encode(), gen, layout.WRITING, **_call(gen))
            else:
                index = d.publish(name, gen, layout.WRITING, **_call(gen))
            indexes.append(index)
            if index is not None and gen % 3:
                d.set_state(index, gen, layout.GONE if gen % 3 == 1 else layout.SEALED)
        maps.append((indexes, bytes(d._map), dict(d._taken), set(d._tombs)))
        d.close()
    assert maps[0][0] == maps[1][0] and None in maps[0][0]   # (some probe found no room)
    assert maps[0][1] == maps[1][1]
    assert maps[0][2:] == maps[1][2:]


def _call(gen: int) -> dict:
    f = _fields(gen)
    return {"alloc": f["alloc"], "offset": f["offset"], "size": f["size"], "word": f["word"], "seq": f["seq"],
            "event": f["event"], "dtype": f["dtype"] and f["dtype"] * (1 + gen % 5),
            "shape": f["shape"] if gen % 11 else [1] * 9, "has_user_meta": f["has_user_meta"],
            "in_arena": f["in_arena"], "kept_event": f["kept_event"]}


def test_a_bad_publish_is_an_error_and_writes_nothing():
    d = layout.Directory("t", 8)
    before = bytes(d._map)
    with pytest.raises(ValueError, match="longer than its place"):
        native.publish(d._map, 8, 8, b"n" * 256, 1, layout.WRITING, 0, 0, 1, 0, 1, b"", b"", b"", 0, 0)
    with pytest.raises(ValueError, match="longer than its place"):
        native.publish(d._map, 8, 8, b"n", 1, layout.WRITING, 0, 0, 1, 0, 1, b"e" * 65, b"", b"", 0, 0)
    with pytest.raises(ValueError, match="capacity beyond its map"):
        native.publish(d._map, 1 << 20, 8, b"n", 1, layout.WRITING, 0, 0, 1, 0, 1, b"", b"", b"", 0, 0)
    assert bytes(d._map) == before
    d.close()


def test_each_sides_c_calls_can_be_switched_off_and_on_again():
    """``shm.native.use``: what ``bench/handoff.py --reader-ab``/``--writer-ab`` alternate. Off, the
    modules see no C call and take their Python; on, the built ones again."""
    from ipcpool.shm import leases, native as switch, requests, sealboard

    calls = {"reader": lambda: (layout._native_lookup, layout._native_state, leases.native_take),
             "writer": lambda: (requests.put_ready, requests.put_sealed, sealboard._native_record_post)}
    for side, now in calls.items():
        assert switch.built(side)
        built = now()
        try:
            switch.use(side, False)
            assert set(now()) == {None}
            other = calls["writer" if side == "reader" else "reader"]()
            assert None not in other   # (the other side's untouched)
        finally:
            switch.use(side, True)
        assert now() == built
