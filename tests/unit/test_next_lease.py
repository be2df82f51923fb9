"""A directory reader's next lease, made ahead (``handoff.NextLease``): which range it guesses,
that a guess is used only for the range and arena the entry names, and that it makes nothing for
objects read in no order."""

from ipcpool._client.handoff import NextLease


class Made:
    """What ``lease_at`` makes: a buffer-like record of where it was made."""

    def __init__(self, at, arena):
        self.at, self.memory = at, arena


def spot(offset, pool="default", alloc=1, size=1 << 20):
    return (pool, alloc, offset, size, None, None)


def read(nl, at, arena, arenas):
    """One get: the guess made while waiting, then the entry ``at`` taken; what take gave back."""
    nl.make(lambda pool, alloc: arenas.get(alloc), Made)
    return nl.take(at, arena)


def test_a_writers_ranges_in_turn_are_guessed_once_seen():
    nl, arena = NextLease(), object()
    arenas = {1: arena}
    turn = [spot(0), spot(1 << 20), spot(2 << 20)]
    got = [read(nl, turn[k % 3], arena, arenas) for k in range(9)]
    # Nothing made until each successor was seen twice (c -> a the second time at the 7th)
    assert got[:7] == [None] * 7
    for k, buf in enumerate(got[7:], start=7):
        assert buf is not None and buf.at == turn[k % 3] and buf.memory is arena


def learnt(arena, arenas):
    """A reader that has seen 1 MiB follow 0 twice and has just read 0: its guess is 1 MiB."""
    nl = NextLease()
    for at in (spot(0), spot(1 << 20), spot(0), spot(1 << 20), spot(0)):
        read(nl, at, arena, arenas)
    return nl


def test_a_guess_for_another_range_size_or_type_is_not_used():
    arena = object()
    arenas = {1: arena}
    assert read(learnt(arena, arenas), spot(1 << 20), arena, arenas) is not None   # the guess itself
    for other in (spot(2 << 20), spot(1 << 20, size=4096), ("default", 1, 1 << 20, 1 << 20, "float32", (4, 4)),
                  spot(1 << 20, alloc=2), spot(1 << 20, pool="other")):
        assert read(learnt(arena, arenas), other, arena, arenas) is None


def test_a_guess_made_over_an_arena_imported_since_is_not_used():
    nl, old, new = NextLease(), object(), object()
    arenas = {1: old}
    for at in (spot(0), spot(1 << 20), spot(0), spot(1 << 20), spot(0)):
        read(nl, at, old, arenas)
    assert read(nl, spot(1 << 20), new, arenas) is None   # made over ``old``; the entry's arena is ``new``


def test_one_late_range_does_not_unlearn_the_turn():
    nl, arena = NextLease(), object()
    arenas = {1: arena}
    a, b, c = spot(0), spot(1 << 20), spot(2 << 20)
    for at in (a, b, c, a, b, c, a, b, c, a):   # the turn seen three times
        read(nl, at, arena, arenas)
    assert read(nl, c, arena, arenas) is None   # a range given back late: c came after a once
    assert read(nl, a, arena, arenas) is not None   # after c comes a, as before
    assert read(nl, b, arena, arenas) is not None   # after a still comes b: one surprise is not enough


def test_no_arena_here_makes_nothing():
    nl, arena = NextLease(), object()
    for at in (spot(0), spot(1 << 20), spot(0), spot(1 << 20), spot(0)):
        read(nl, at, arena, {1: arena})
    assert read(nl, spot(1 << 20), arena, {}) is None


def test_objects_read_in_no_order_make_nothing():
    nl, arena = NextLease(), object()
    arenas = {1: arena}
    made = []
    for k in range(64):   # each range followed by another each time: no successor is seen twice
        nl.make(lambda pool, alloc: arenas.get(alloc), lambda at, a: made.append(at) or Made(at, a))
        nl.take(spot((k * 7919 % 64) << 20), arena)
    assert made == []


def test_what_a_get_takes_is_learnt_at_the_next_make_not_on_its_path():
    nl, arena = NextLease(), object()
    arenas = {1: arena}
    for at in (spot(0), spot(1 << 20), spot(0), spot(1 << 20), spot(0)):
        nl.take(at, arena)   # (gets only: a reader that holds its leases)
    assert nl._after == {} and len(nl._taken) == 5   # nothing learnt on the get's path
    nl.make(lambda pool, alloc: arenas.get(alloc), Made)   # (its release): learnt, and the guess made
    assert nl._taken == [] and nl._after[spot(0)] == [spot(1 << 20), 1]
    assert nl.take(spot(1 << 20), arena).at == spot(1 << 20)


def test_a_reader_that_never_makes_learns_in_bounded_steps():
    nl, arena = NextLease(), object()
    for k in range(3 * NextLease.UNLEARNT):
        nl.take(spot((k % 2) << 20), arena)
        assert len(nl._taken) < NextLease.UNLEARNT
    assert nl._after[spot(0)][0] == spot(1 << 20) and nl._after[spot(1 << 20)][0] == spot(0)
