"""Arenas on the host backend: creates carved by the client without a round trip, checked and
mirrored by the broker, ranges handed back once idle, refusals surfacing later (flush)."""

import pytest

import ipcpool

MiB = 1 << 20
ARENA = 4 * MiB   # small, so that a run of objects must reuse its ranges


def used(c):
    return c.stats()["pools"]["default"]["used"]


def test_ranges_come_back_once_readers_are_done(broker):
    with ipcpool.connect(broker.socket_dir, arena_bytes=ARENA) as w, ipcpool.connect(broker.socket_dir) as r:
        carved = []
        for i in range(40):   # 40 MiB of objects through 4 MiB arenas
            buf = w.create(f"a/{i}", MiB)
            buf.view[:2] = bytes([i % 251, 7])
            carved.append(buf.carved_at)
            buf.seal()
            with r.get(f"a/{i}") as lease:
                assert bytes(lease.view[:2]) == bytes([i % 251, 7])
            w.delete(f"a/{i}")
        assert None not in carved                       # no create waited for the broker
        assert len({aid for aid, _ in carved}) <= 2     # ranges reused: one arena, or two if a
                                                        # reclaim notice was still on its way
        assert used(w) in (ARENA, 2 * ARENA)            # arenas stay the session's while it lives
        pool = w.stats()["pools"]["default"]
        assert pool["arena_bytes"] == used(w) and pool["arena_free"] == used(w)   # all carved ranges back
    with ipcpool.connect(broker.socket_dir) as c:
        assert used(c) == 0                             # and go with it


def test_a_refused_create_loses_nothing(broker):
    with ipcpool.connect(broker.socket_dir, arena_bytes=ARENA) as c:
        c.create("x", MiB).seal()
        clash = c.create("x", MiB)
        at = clash.carved_at
        with pytest.raises(ipcpool.ObjectExists, match="an object named 'x' already exists"):
            clash.seal()                                # never waits for the broker: the refusal
            c.flush()                                   # is raised by seal once known, else later
        assert c.async_errors and isinstance(c.async_errors[-1], ipcpool.ObjectExists)
        assert c.create("y", MiB).carved_at == at       # the range came straight back
        assert [o["name"] for o in c.list()] == ["x", "y"]
        pool = c.stats()["pools"]["default"]
        assert pool["arena_bytes"] == ARENA and pool["arena_free"] == ARENA - 2 * MiB   # x and y
        aborted = c.create("z", MiB)
        aborted.free()                                  # never sealed: freed, not published
        with pytest.raises(ipcpool.ObjectNotFound):
            c.get("z", timeout=0)


def test_a_steady_writers_next_carve_is_made_ready_and_given_back_when_the_size_changes(broker):
    with ipcpool.connect(broker.socket_dir, arena_bytes=ARENA) as w, ipcpool.connect(broker.socket_dir) as r:
        handoff = w._leases.handoff
        for i in range(2):
            w.create(f"s/{i}", MiB).seal()
        [ready] = handoff._ahead                        # the second of one size: its seal made the next ready
        assert ready.name is None                       # (one: a quarter of this arena holds one)
        buf = w.create("s/2", MiB)
        assert buf is ready and buf.carved_at == ready.carved_at and buf.name == "s/2"
        buf.view[:3] = b"abc"
        buf.seal()
        with r.get("s/2") as lease:                     # another process reads what went into it
            assert bytes(lease.view[:3]) == b"abc"
        aid, offset = handoff._ahead[0].carved_at
        arena = handoff._by_arena[aid]
        assert arena.ranges.taken(offset)               # held for the next 1 MiB create
        half = w.create("half", MiB // 2)               # another size: the ready range goes back,
        assert not handoff._ahead and half.carved_at == (aid, offset)   # and serves it
        half.seal()
        w.flush()
        assert not w.async_errors                       # nothing freed that the broker never had
        assert sorted(o["name"] for o in w.list()) == ["half", "s/0", "s/1", "s/2"]


@pytest.mark.parametrize("arena_mib, made", [(32, 4), (8, 2)])
def test_a_steady_writer_has_its_next_carves_made_ready_a_few_at_a_time(broker, arena_mib, made):
    """One seal makes the next few creates' carves ready (at most four, and at most a quarter of an
    arena's bytes); the creates take them in turn, and the seal after the last makes the next few.
    A create of another size gives every one back: their ranges and board words are free again."""
    with ipcpool.connect(broker.socket_dir, arena_bytes=arena_mib * MiB) as w, \
            ipcpool.connect(broker.socket_dir) as r:
        handoff = w._leases.handoff
        for i in range(2):
            w.create(f"s/{i}", MiB).seal()
        ready = list(handoff._ahead)                    # made at the second seal of this size
        assert len(ready) == made and all(b.name is None for b in ready)
        assert len({b.carved_at for b in ready}) == made   # each its own range
        for k, want in enumerate(ready):
            buf = w.create(f"s/{2 + k}", MiB)
            assert buf is want and buf.name == f"s/{2 + k}"
            buf.view[:2] = bytes([k, 9])
            buf.seal()
            assert len(handoff._ahead) == (made - 1 - k or made)   # the last one's seal made more
        for k in range(made):
            with r.get(f"s/{2 + k}") as lease:          # another process reads what went into each
                assert bytes(lease.view[:2]) == bytes([k, 9])
        held = [(b.carved_at, b.carving.slot) for b in handoff._ahead]
        odd = w.create("odd", MiB // 2)                 # another size: all of them go back
        assert not handoff._ahead
        for (aid, offset), slot in held:
            arena = handoff._by_arena[aid]
            assert slot in arena.slots                  # the board word is free again
        taken = sum(a.ranges.size_of(o) for a in handoff._by_arena.values() for o in a.ranges.offsets())
        assert taken == (2 + made) * MiB + MiB // 2     # the objects' ranges alone (none is deleted)
        odd.seal()
        w.flush()
        assert not w.async_errors                       # nothing freed that the broker never had
        assert len(w.list("s/")) == 2 + made


def test_a_steady_writer_that_waits_on_a_call_has_a_carve_made_ready_meanwhile(broker):
    """A steady writer's call that waits for its reply (a delete here) makes one carve more ready
    meanwhile, up to the few a seal makes: its seals find carves ready and make none, and each
    object, in a range of its own, reads back whole."""
    with ipcpool.connect(broker.socket_dir, arena_bytes=32 * MiB) as w, \
            ipcpool.connect(broker.socket_dir) as r:
        handoff = w._leases.handoff
        for i in range(2):
            w.create(f"s/{i}", MiB).seal()
        assert len(handoff._ahead) == 4                 # made at the second seal of this size
        after_seal, after_delete = [], []
        for i in range(2, 22):
            buf = w.create(f"s/{i}", MiB)
            buf.view[:2] = bytes([i, 7])
            buf.seal()
            after_seal.append(len(handoff._ahead))
            live = {buf.carved_at} | {b.carved_at for b in handoff._ahead}
            assert len(live) == 1 + len(handoff._ahead)   # each its own range
            with r.get(f"s/{i}") as lease:
                assert bytes(lease.view[:2]) == bytes([i, 7])
            w.delete(f"s/{i - 2}")
            after_delete.append(len(handoff._ahead))
        assert after_seal == [3] * 20                   # no seal found none left (none made four)
        assert after_delete == [4] * 20                 # each delete's wait made the one used
        w.flush()
        assert not w.async_errors
        assert [o["name"] for o in w.list("s/")] == ["s/20", "s/21"]


def test_a_steady_writer_under_a_quota_too_small_for_its_carves_made_ready_loses_nothing(start_broker):
    """A bytes quota that holds the first arena (4 MiB) and not the next: the carves made ready
    at a seal stop where the arena refused ends them, and every hand-off still goes through,
    read back whole, with no refusal raised and the quota kept."""
    b = start_broker(config_text=f"[quotas.default]\nbytes = {6 * MiB}\n")
    with ipcpool.connect(b.socket_dir) as w, ipcpool.connect(b.socket_dir) as r:
        handoff = w._leases.handoff
        made = []
        for i in range(30):
            buf = w.create(f"q/{i}", MiB)
            buf.view[:2] = bytes([i % 251, 5])
            buf.seal()
            made.append(len(handoff._ahead))
            with r.get(f"q/{i}", timeout=5) as lease:
                assert bytes(lease.view[:2]) == bytes([i % 251, 5])
            w.delete(f"q/{i}")
        w.flush()
        assert not w.async_errors
        assert 0 < max(made) < 4                        # made ready, fewer than four: no arena for more
        assert len(handoff._arenas["default"]) == 1     # the second arena was refused
        assert used(w) <= 6 * MiB


def test_flush_waits_for_the_frees_that_gave_up_objects(broker):
    """A free that gives up an unsealed object is a request sent without waiting too: after
    ``flush`` its name is gone for every session (the creates around it go through the ring, which
    the broker may read before the message channel)."""
    with ipcpool.connect(broker.socket_dir) as w, ipcpool.connect(broker.socket_dir) as r:
        for i in range(60):
            w.create(f"gone/{i}", 4096).free()
            kept = w.create(f"kept/{i}", 4096)
            kept.seal()
            w.flush()
            assert [o["name"] for o in r.list("gone/")] == [], i
        assert len(r.list("kept/")) == 60


def test_broker_checks_every_carved_range(broker):
    with ipcpool.connect(broker.socket_dir, arena_bytes=ARENA) as a, ipcpool.connect(broker.socket_dir) as b:
        first = a.create("mine", MiB)
        aid, taken = first.carved_at
        create = dict(nbytes=MiB, pool="default")
        cases = [
            (b, dict(name="b1", arena=aid, offset=0), f"arena {aid} is not one of this session's"),
            (a, dict(name="a1", arena=aid, offset=taken), "is not free"),
            (a, dict(name="a2", arena=aid, offset=ARENA - 512), "is not free"),   # runs past the end
            (a, dict(name="a3", arena=aid, offset=100), "not aligned"),
            (a, dict(name="a4", arena=aid), "arena and offset go together"),
            (a, dict(name="a5", arena=aid + 1000, offset=0), "is not one of this session's"),
        ]
        for client, fields, message in cases:
            with pytest.raises(ipcpool.InvalidRequest, match=message):
                client._channel.call("create", **create, **fields)
        first.view[:3] = b"abc"
        first.seal()                                    # the broker serves on, unharmed
        with b.get("mine") as lease:
            assert bytes(lease.view[:3]) == b"abc"
        assert sorted(o["name"] for o in b.list()) == ["mine"]
