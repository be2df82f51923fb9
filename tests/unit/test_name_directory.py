"""The name directory's layout on a real memfd: lookups, tombstones, and their trimming. Each test
runs with the reader's C lookup (``shm/_native.c``, where the package was built with it) and with
the Python one."""

import os

import pytest

from ipcpool.shm import directory as layout


@pytest.fixture(autouse=True, params=["native", "python"])
def reader_kind(request, monkeypatch):
    if request.param == "native" and layout._native_lookup is None:
        pytest.skip("ipcpool.shm._native is not built here (no C compiler when it was installed)")
    if request.param == "python":
        monkeypatch.setattr(layout, "_native_lookup", None)
        monkeypatch.setattr(layout, "_native_state", None)
    return request.param


def _reader(d: layout.Directory) -> layout.DirectoryView:
    return layout.DirectoryView(os.dup(d.fd), d.capacity)


def _publish(d: layout.Directory, name: str, gen: int) -> int:
    return d.publish(name, gen, layout.WRITING, 7, 0, 64, 3, 1, b"e" * 64, "float32", [4, 4], False, True, True)


def test_a_reader_finds_what_the_broker_wrote_and_misses_what_it_did_not():
    d = layout.Directory("t", 64)
    view = _reader(d)
    index = _publish(d, "a/b", 1)
    got = view.lookup("a/b")
    assert (got.index, got.gen, got.state, got.dtype, got.shape, got.kept_event) == (index, 1, layout.WRITING,
                                                                                        "float32", (4, 4), True)
    assert view.lookup("a/c") is None
    d.set_state(index, 1, layout.SEALED, event=b"f" * 64)
    sealed = view.lookup("a/b")
    assert (sealed.state, sealed.event, sealed.kept_event) == (layout.SEALED, b"f" * 64, False)
    view.close()
    d.close()


def test_deleting_names_leaves_no_tombstones_for_misses_to_walk():
    """Thousands of create/delete pairs (each name new, as hand-offs go): a miss stays one probe.
    Fails if gone entries stay tombstones: every miss would then probe MAX_PROBE entries."""
    d = layout.Directory("t", 1024)
    view = _reader(d)
    for gen in range(1, 5001):
        index = _publish(d, f"h/{gen}", gen)
        d.set_state(index, gen, layout.GONE)
    assert not d._tombs
    states = {int.from_bytes(view._map[(i + 1) * layout.ENTRY + 16:(i + 1) * layout.ENTRY + 20], "little")
              for i in range(d.capacity)}
    assert states == {layout.EMPTY}   # every entry empty again: a miss stops at its home
    assert view.lookup("never/there") is None
    view.close()
    d.close()


def test_a_live_entry_behind_a_gone_one_is_still_found_and_a_hazard_on_the_gone_one_reads_gone():
    d = layout.Directory("t", 8)
    view = _reader(d)
    home = layout.home(b"x", 8)
    names = [n for n in (f"n{i}" for i in range(2000)) if layout.home(n.encode(), 8) == home][:3]
    first, second, third = (_publish(d, n, g) for g, n in enumerate(names, 1))
    d.set_state(second, 2, layout.GONE)   # between two live ones: stays a tombstone
    assert view.lookup(names[2]).index == third
    d.set_state(third, 3, layout.GONE)    # the end of the run: both become empty
    assert not d._tombs
    assert view.state(second, 2) == layout.GONE and view.state(third, 3) == layout.GONE
    assert view.lookup(names[0]).index == first
    view.close()
    d.close()


def _same_home(capacity: int, count: int) -> list[str]:
    names, home = [], None
    for k in range(10_000):
        name = f"n/{k}"
        if home is None:
            home = layout.home(name.encode(), capacity)
        if layout.home(name.encode(), capacity) == home:
            names.append(name)
            if len(names) == count:
                return names
    raise AssertionError("no names sharing a home")


def test_an_entry_the_broker_is_writing_is_read_again_never_passed_and_then_given_up_on():
    """The seqlock: an odd version is an entry mid-write, the name being written may be the one
    looked for, so the probe neither reads it as whole nor passes it; after TORN_READS it answers
    None (the caller looks again or asks the broker), and once whole the name is found."""
    d = layout.Directory("t", 8)
    view = _reader(d)
    first, second = _same_home(8, 2)
    at_first = _publish(d, first, 1)
    at_second = _publish(d, second, 2)
    assert at_second != at_first and view.lookup(second).gen == 2   # found one probe past the first
    ver_at = (at_first + 1) * layout.ENTRY // 8
    d._words[ver_at] += 1   # the first entry, mid-write
    assert view.lookup(first) is None and view.lookup(second) is None
    d._words[ver_at] += 1   # whole again
    assert view.lookup(first).gen == 1 and view.lookup(second).gen == 2
    view.close()
    d.close()
