"""A directory reader's next lease, made while it waits (``handoff.NextLease``): which range it
guesses, and that a guess is used only for the range and arena the entry names."""

from ipcpool._client.handoff import NextLease


class Made:
    """What ``lease_at`` makes: a buffer-like record of where it was made."""

    def __init__(self, at, arena):
        self.at, self.memory = at, arena


def spot(offset, pool="default", alloc=1, size=1 << 20):
    return (pool, alloc, offset, size, None, None)


def read(nl, at, arena, arenas):
    """One get: the guess made while waiting, then the entry ``at`` taken; what take gave back."""
    nl.make(lambda where: arenas.get(where[1]), Made)
    return nl.take(at, arena)


def test_a_writers_ranges_in_turn_are_guessed_once_seen():
    nl, arena = NextLease(), object()
    arenas = {1: arena}
    turn = [spot(0), spot(1 << 20), spot(2 << 20)]
    got = [read(nl, turn[k % 3], arena, arenas) for k in range(9)]
    assert got[:4] == [None] * 4   # each range's successor is seen once first (c -> a at the 4th)
    for k, buf in enumerate(got[4:], start=4):
        assert buf is not None and buf.at == turn[k % 3] and buf.memory is arena


def test_a_guess_for_another_range_size_or_type_is_not_used():
    nl, arena = NextLease(), object()
    arenas = {1: arena}
    for at in (spot(0), spot(1 << 20), spot(0)):
        read(nl, at, arena, arenas)
    # Learnt: after 0 comes 1 MiB. The entry names something else each time: never the guess.
    assert read(nl, spot(2 << 20), arena, arenas) is None
    read(nl, spot(0), arena, arenas)
    assert read(nl, spot(1 << 20, size=4096), arena, arenas) is None
    read(nl, spot(0), arena, arenas)
    assert read(nl, ("default", 1, 1 << 20, 1 << 20, "float32", (4, 4)), arena, arenas) is None


def test_a_guess_made_over_an_arena_imported_since_is_not_used():
    nl, old, new = NextLease(), object(), object()
    arenas = {1: old}
    for at in (spot(0), spot(1 << 20), spot(0)):
        read(nl, at, old, arenas)
    assert read(nl, spot(1 << 20), new, arenas) is None   # made over ``old``; the entry's arena is ``new``


def test_one_late_range_does_not_unlearn_the_turn():
    nl, arena = NextLease(), object()
    arenas = {1: arena}
    a, b, c = spot(0), spot(1 << 20), spot(2 << 20)
    for at in (a, b, c, a, b, c, a):
        read(nl, at, arena, arenas)
    assert read(nl, c, arena, arenas) is None   # a range given back late: c came after a once
    assert read(nl, a, arena, arenas) is not None   # after c comes a, as before
    assert read(nl, b, arena, arenas) is not None   # after a still comes b: one surprise is not enough


def test_no_arena_here_makes_nothing():
    nl, arena = NextLease(), object()
    for at in (spot(0), spot(1 << 20), spot(0)):
        read(nl, at, arena, {1: arena})
    assert read(nl, spot(1 << 20), arena, {}) is None
