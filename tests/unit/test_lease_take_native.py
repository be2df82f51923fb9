"""A reader's lookup, hazard slot and check in one C call (``ClientLeasePage.take_in_c``, read by ``leases.taken``) against
the three Python calls it stands for (``DirectoryView.lookup``, ``ClientLeasePage.take``,
``DirectoryView.state``), on a real directory and real lease pages: the same entry, the same slot
bytes the broker reads, the same state; and no slot taken where the caller must decide."""

import os

import pytest

from ipcpool.backend.cuda.credits import CreditTable
from ipcpool.shm import directory as layout
from ipcpool.shm.leases import HEAD, SLOT, SLOTS, ClientLeasePage, LeasePage, taken

native = pytest.importorskip("ipcpool.shm._native", reason="not built here (no C compiler when installed)")

POOL, ARENA = 3, 11


def take_entry(page, view, name, pool, arenas, sealed_only, made=None, credits=None):
    """The C take on ``page`` as the reader's get calls it (``Handoff._found``), its answer read."""
    return taken(page.take_in_c(view.mapping, view.capacity, view.probes, name.encode(), pool, arenas,
                                sealed_only, made, credits))


@pytest.fixture
def world():
    d = layout.Directory("t", 256)
    view = layout.DirectoryView(os.dup(d.fd), d.capacity)
    pages = [LeasePage(), LeasePage()]   # (the broker's side of each: what its scan reads)
    clients = [ClientLeasePage(os.dup(p.fd)) for p in pages]
    yield d, view, pages, clients
    view.close()
    d.close()
    for p in pages:
        p.close()


def _publish(d, name, gen, state=layout.SEALED, in_arena=True, user=False, alloc=ARENA):
    return d.publish(name, gen, state, alloc, gen * 4096, 4096, gen % 200, gen, bytes([gen % 250 + 1]) * 64,
                     "float16", [2, 1024], user, in_arena, True)


def test_each_take_reads_and_writes_what_the_three_python_calls_do(world):
    d, view, (page_c, page_py), (c, py) = world
    for gen in range(1, 150):
        _publish(d, f"obj/{gen}", gen, layout.SEALED if gen % 3 else layout.WRITING)
    for gen in range(1, 150, 5):   # some gone again
        d.set_state(view.lookup(f"obj/{gen}").index, gen, layout.GONE)
    taken = 0
    for gen in range(1, 160):
        name = f"obj/{gen}"
        want = view.lookup(name)
        got = take_entry(c, view, name, POOL, {ARENA: object()}, False)
        if want is None:
            assert got is None
            continue
        entry, slot_state = got
        assert entry == want
        (slot, nonce), state = slot_state
        assert (slot, nonce) == py.take(POOL, want.index, want.gen)
        assert state == view.state(want.index, want.gen) == want.state
        taken += 1
    assert taken > 100 and page_c.live() == page_py.live() and len(page_c.live()) == taken
    assert bytes(page_c._map[:4096]) == bytes(page_py._map[:4096])   # (count, slots and nonces, byte for byte)


@pytest.mark.parametrize("case", ["metadata beyond dtype and shape", "its own allocation", "an arena not imported",
                                  "not sealed, asked sealed only", "every slot in use"])
def test_no_slot_is_taken_where_the_caller_decides(world, case):
    d, view, (page, _), (c, _) = world
    _publish(d, "x", 1, state=layout.WRITING if case.startswith("not sealed") else layout.SEALED,
             in_arena=case != "its own allocation", user=case.startswith("metadata"))
    arenas = {} if case == "an arena not imported" else {ARENA: object()}
    if case == "every slot in use":
        for _ in range(SLOTS):
            c.take(POOL, 0, 0)
    before = bytes(page._map[:4096])
    entry, slot_state = take_entry(c, view, "x", POOL, arenas, case.startswith("not sealed"))
    assert entry == view.lookup("x") and slot_state is None
    assert bytes(page._map[:4096]) == before


def test_the_slot_names_the_entrys_own_object_for_the_brokers_scan(world):
    """An entry reused by a later object: the slot names that object (its gen), the state read
    after it is that object's, and once the broker marks it gone the scan still finds the slot."""
    d, view, (page, _), (c, _) = world
    index = _publish(d, "x", 1)
    d.set_state(index, 1, layout.GONE)
    _publish(d, "x", 2)
    entry, ((slot, nonce), state) = take_entry(c, view, "x", POOL, {ARENA: object()}, False)
    assert entry.gen == 2 and state == layout.SEALED
    d.set_state(entry.index, 2, layout.GONE)
    assert view.state(entry.index, 2) == layout.GONE
    assert page.live() == [(slot, POOL, entry.index, 2, nonce)]


def test_the_c_page_layout_is_the_pythons():
    assert (native.LEASE_SLOTS, native.LEASE_SLOT, native.LEASE_HEAD) == (SLOTS, SLOT, HEAD)


# -- the lease made ahead: a sealed object where it lies, its seal done, taken with nothing made --

def _publish_typed(d, name, gen, dtype, shape, event=bytes(64), kept=False, state=layout.SEALED):
    return d.publish(name, gen, state, ARENA, gen * 4096, 4096, gen % 200, gen, event, dtype, shape, False, True, kept)


def _where(e):
    return layout.where_key(e.alloc, e.offset, e.size, e.dtype, e.shape)


TYPES = [(None, None), ("uint8", None), ("float16", [2, 1024]), ("bfloat16", []), ("int64", list(range(1, 9))),
         ("x" * 32, [7])]


@pytest.mark.parametrize("dtype, shape", TYPES)
def test_a_sealed_object_where_the_lease_made_ahead_lies_is_taken_with_nothing_made(world, dtype, shape):
    """No event to wait for (host memory): (None, slot, nonce, index, gen), and the slot bytes the
    broker reads are those the Python take writes."""
    d, view, (page_c, page_py), (c, py) = world
    _publish_typed(d, "x", 5, dtype, shape)
    want = view.lookup("x")
    lease, other = object(), object()
    made = {_where(want): lease, b"elsewhere": other}
    got = take_entry(c, view, "x", POOL, {ARENA: object()}, False, made, CreditTable().rows)
    assert got[0] is None and got[3:5] == (want.index, want.gen) and got[5] is lease
    assert made == {b"elsewhere": other}   # (taken out: used once)
    assert got[1:3] == py.take(POOL, want.index, want.gen)
    assert bytes(page_c._map[:4096]) == bytes(page_py._map[:4096])


@pytest.mark.parametrize("case", ["another offset", "another size", "another dtype", "another shape", "no shape",
                                  "not sealed", "an event not kept", "a kept event not open here",
                                  "a kept event open here (no driver to ask)"])
def test_anything_else_comes_as_the_entry_and_its_slot(world, case):
    """Where the object lies elsewhere, is not sealed, or its seal's event cannot be seen done
    here, the caller gets the entry and its slot as without a lease made ahead."""
    from tests.unit.test_sealboard_sleep import _driver_loaded

    if case.startswith("a kept event open") and _driver_loaded():
        pytest.skip("a CUDA driver here would be asked about a made-up event")
    d, view, _, (c, _) = world
    event = bytes(range(1, 65)) if "event" in case else bytes(64)
    _publish_typed(d, "x", 5, "float16", [2, 1024], event=event, kept="kept" in case,
                   state=layout.WRITING if case == "not sealed" else layout.SEALED)
    e = view.lookup("x")
    made = {"another offset": (e.alloc, e.offset + 4096, e.size, e.dtype, e.shape),
            "another size": (e.alloc, e.offset, e.size * 2, e.dtype, e.shape),
            "another dtype": (e.alloc, e.offset, e.size, "float32", e.shape),
            "another shape": (e.alloc, e.offset, e.size, e.dtype, (1024, 2)),
            "no shape": (e.alloc, e.offset, e.size, e.dtype, None)}.get(case, (e.alloc, e.offset, e.size, e.dtype, e.shape))

    credits = CreditTable()   # (a credit as the CUDA pool keeps it open: its CUevent as an int)
    if case.startswith("a kept event open"):
        credits.put(event, 0x1234)
    ahead = {layout.where_key(*made): object()}
    given = dict(ahead)
    entry, ((slot, nonce), state) = take_entry(c, view, "x", POOL, {ARENA: object()}, False, given, credits.rows)
    assert entry == e and state == e.state and (slot, nonce) == (0, 1)   # (the first slot taken)
    assert given == ahead   # (the lease made ahead is left for its own object)


def test_the_made_key_is_what_the_broker_writes():
    """``where_key`` of an entry's own fields is the bytes of its place and type as written: a
    dtype past 32 bytes is cut as the broker cuts it."""
    d = layout.Directory("k", 16)
    view = layout.DirectoryView(os.dup(d.fd), d.capacity)
    try:
        _publish_typed(d, "long", 1, "y" * 40, [3])
        e = view.lookup("long")
        assert e.dtype == "y" * 32
        assert layout.where_key(e.alloc, e.offset, e.size, "y" * 40, e.shape) == _where(e)
    finally:
        view.close()
        d.close()
