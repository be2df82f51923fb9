"""A directory reader's next leases, made ahead (``handoff.NextLease``): one for each range read
twice, used only for the range, type and arena the entry names, bounded, and nothing made for
objects that never share a range."""

import random

from ipcpool._client.handoff import NextLease
from ipcpool.shm import directory


class Made:
    """What ``lease_at`` makes: a buffer-like record of where it was made."""

    def __init__(self, at, arena):
        self.at, self.memory = at, arena


def spot(offset, pool="default", alloc=1, size=1 << 20):
    return (pool, alloc, offset, size, None, None)


def read(nl, at, arena, arenas):
    """One get and its release: the entry ``at`` taken, then what is made ahead as it is released;
    what the take gave back."""
    got = nl.take(at, arena)
    nl.make(lambda pool, alloc: arenas.get(alloc), Made)
    return got


def test_a_writers_ranges_are_made_ahead_once_each_was_read_twice():
    nl, arena = NextLease(), object()
    arenas = {1: arena}
    turn = [spot(0), spot(1 << 20), spot(2 << 20)]
    got = [read(nl, turn[k % 3], arena, arenas) for k in range(9)]
    assert got[:6] == [None] * 6   # each read twice first
    for k, buf in enumerate(got[6:], start=6):
        assert buf is not None and buf.at == turn[k % 3] and buf.memory is arena


def test_ranges_given_back_in_any_order_are_all_made():
    """Late reclaims reorder a writer's ranges: whichever comes next, a lease is made there."""
    nl, arena = NextLease(), object()
    arenas = {1: arena}
    ranges = [spot(k << 20) for k in range(6)]
    for at in ranges + ranges:
        read(nl, at, arena, arenas)
    shuffled = random.Random(7)
    for _ in range(20):
        turn = ranges[:]
        shuffled.shuffle(turn)
        for at in turn:
            buf = read(nl, at, arena, arenas)
            assert buf is not None and buf.at == at


def made_twice(at, arena, arenas):
    nl = NextLease()
    read(nl, at, arena, arenas)
    read(nl, at, arena, arenas)
    return nl


def test_a_lease_made_for_another_range_size_type_arena_or_pool_is_not_used():
    arena = object()
    arenas = {1: arena}
    at = spot(1 << 20)
    assert made_twice(at, arena, arenas).take(at, arena) is not None   # the range itself
    for other in (spot(2 << 20), spot(1 << 20, size=4096), ("default", 1, 1 << 20, 1 << 20, "float32", (4, 4)),
                  spot(1 << 20, alloc=2), spot(1 << 20, pool="other")):
        nl = made_twice(at, arena, arenas)
        assert nl.take(other, arena) is None
        assert nl.take(at, arena) is not None   # (still there for its own range)


def test_a_lease_made_over_an_arena_imported_since_is_not_used():
    old, new = object(), object()
    nl = made_twice(spot(0), old, {1: old})
    assert nl.take(spot(0), new) is None   # made over ``old``; the entry's arena is ``new``


def test_a_lease_is_used_once():
    arena = object()
    nl = made_twice(spot(0), arena, {1: arena})
    assert nl.take(spot(0), arena) is not None
    assert nl.take(spot(0), arena) is None   # (a second lease on it before a release: made after)


def test_the_c_take_looks_leases_up_by_the_brokers_key():
    """``made`` is keyed as the C take keys an entry (``directory.where_key``), a dict per pool."""
    arena = object()
    at = ("default", 1, 4096, 256, "float16", (8, 16))
    nl = made_twice(at, arena, {1: arena})
    (key, (where, imported, buf)), = nl.made["default"].items()
    assert key == directory.where_key(1, 4096, 256, "float16", (8, 16)) and where == at and imported is arena
    assert nl.hit("n", nl.made["default"].pop(key), (0, 1, 2, 3, 4), entered := {}) is buf
    assert buf.name == "n" and buf.dirlease == (0, 1, 2, 3, 4) and entered == {id(buf): buf}


def test_no_arena_here_makes_nothing():
    nl, arena = NextLease(), object()
    for _ in range(3):
        read(nl, spot(0), arena, {})
    assert not nl.made.get("default")


def test_objects_that_never_share_a_range_make_nothing():
    nl, arena = NextLease(), object()
    arenas = {1: arena}
    made = []
    for k in range(64):   # each range read once
        nl.take(spot(k << 20), arena)
        nl.make(lambda pool, alloc: arenas.get(alloc), lambda at, a: made.append(at) or Made(at, a))
    assert made == []


def test_the_leases_made_are_bounded_the_least_lately_read_dropped_first():
    nl, arena = NextLease(), object()
    arenas = {1: arena}
    ranges = [spot(k << 20) for k in range(NextLease.MADE_MOST + 4)]
    for at in ranges + ranges:
        read(nl, at, arena, arenas)
    made = nl.made["default"]
    assert len(made) == NextLease.MADE_MOST
    assert [w for w, _, _ in made.values()] == ranges[4:]


def test_what_a_get_takes_is_counted_at_the_next_make_not_on_its_path():
    nl, arena = NextLease(), object()
    arenas = {1: arena}
    for at in (spot(0), spot(1 << 20), spot(0)):
        nl.take(at, arena)   # (gets only: a reader that holds its leases)
    assert nl._seen == {} and len(nl._taken) == 3   # nothing counted on the get's path
    nl.make(lambda pool, alloc: arenas.get(alloc), Made)   # (a release): counted, and made for 0
    assert nl._taken == [] and nl._seen == {spot(0): 2, spot(1 << 20): 1}
    assert nl.take(spot(0), arena).at == spot(0)


def test_a_reader_that_never_makes_counts_in_bounded_steps():
    nl, arena = NextLease(), object()
    for k in range(3 * NextLease.UNLEARNT):
        nl.take(spot((k % 2) << 20), arena)
        assert len(nl._taken) < NextLease.UNLEARNT
    assert nl._seen == {spot(0): 2, spot(1 << 20): 2} and not nl.made
