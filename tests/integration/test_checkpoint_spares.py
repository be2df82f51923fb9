"""A swapped checkpoint's spare on the host backend: the version replaced last is written again
once no reader holds it; a held version is never touched; memory stays at two versions; a pool
short of memory takes the spare back."""

import pytest

import ipcpool
from tests.support.cli import ipcpool_cmd

SPECS = [("w", "float32", (1 << 16,)), ("b", "float32", (256,))]   # 257 KiB


def used(c):
    return c.stats()["pools"]["default"]["used"]


def publish(c, value, specs=SPECS):
    """A version of "m" whose every element is ``value``; its number and the writer's shard addresses."""
    with c.new_version("m", specs) as w:
        ranges = w.ranges()
        for t in w.tensors("numpy").values():
            t[...] = value
        return w.publish(), ranges


def spare(c):
    return c.stats()["checkpoints"]["spare_bytes"]


def test_a_held_version_survives_two_publishes_and_the_spare_is_written_again(broker):
    with ipcpool.connect(broker.socket_dir) as w, ipcpool.connect(broker.socket_dir) as r:
        base = used(w)
        _, at1 = publish(w, 1)
        one = used(w) - base                                   # one version's memory
        held = r.attach("m", kind="numpy")
        _, at2 = publish(w, 2)                                 # v1 replaced while r holds it
        assert spare(w) == 0                                   # (held: no memory kept for later)
        _, at3 = publish(w, 3)                                 # v1 still held: fresh memory for v3
        assert at3 not in (at1, at2) and spare(w) == one       # v2, held by no one, is the spare
        assert used(w) - base == 3 * one                       # v1 (held), v2 (spare), v3 (current)
        _, at4 = publish(w, 4)
        assert at4 == at2                                      # written into the spare
        assert used(w) - base == 3 * one and spare(w) == one   # nothing new; v3 the spare now
        assert held.version == 1 and all((t == 1).all() for t in held.tensors.values())
        with r.attach("m", kind="numpy") as now:
            assert now.version == 4 and all((t == 4).all() for t in now.tensors.values())
        (info,) = w.list_checkpoints()
        assert [(v["version"], v["state"], v["holders"]) for v in info["versions"]] == [(1, "retired", 1), (4, "current", 0)]
        assert info["spare"] == one
        with pytest.raises(ipcpool.ObjectNotFound, match=r"no version 3 \(alive: \[1, 4\]\)"):
            r.attach("m", version=3, kind="numpy")            # a spare is no version to attach
        held.release()                                         # v1 goes: not the spare, freed
        assert used(r) - base == 2 * one                       # (asked by r: after its release)
        assert r.stats()["checkpoints"]["version_bytes"] == spare(r) == one
        r.delete_checkpoint("m")                               # the spare goes with its checkpoint
        assert used(r) == base and spare(r) == 0


def test_a_swap_loop_stays_at_two_versions(broker):
    with ipcpool.connect(broker.socket_dir) as w, ipcpool.connect(broker.socket_dir) as r:
        base = used(w)
        publish(w, 0)
        one = used(w) - base
        ck = r.attach("m", kind="numpy")
        w.reset_high()
        addresses = set()
        for k in range(1, 7):
            v, at = publish(w, k)
            addresses.add(tuple(at))
            assert ck.refresh() and ck.version == v
            assert all((t == k).all() for t in ck.tensors.values())
            r.stats()   # a round trip: r's release of the old version is the broker's before the next publish
        high = w.stats()["pools"]["default"]["used_high"]
        assert high - base <= 2 * one, (high - base, one)      # the bound, from the pool's own high mark
        assert len(addresses) == 2                             # two regions, written in turn
        ck.release()
        r.delete_checkpoint("m")
        assert used(r) == base


def test_another_layout_drops_the_spare(broker):
    with ipcpool.connect(broker.socket_dir) as c:
        base = used(c)
        publish(c, 1)
        publish(c, 2)
        assert spare(c) > 0
        listed = ipcpool_cmd("ls", "--socket-dir", str(broker.socket_dir)).stdout.splitlines()
        assert any(line.split()[:3] == ["m", "-", "spare"] for line in listed), listed
        bigger = [("w", "float32", (1 << 17,))]
        publish(c, 3, bigger)                                  # the spare could never hold it: gone first
        assert spare(c) == 0                                   # and v2, laid out otherwise, is none
        assert used(c) - base == 1 << 19                       # v3 alone
        c.delete_checkpoint("m")
        assert used(c) == base


def test_a_pool_short_of_memory_takes_the_spare_back(start_broker):
    b = start_broker(config_text='[[pools]]\nname = "default"\nmax_size = "1M"\n')
    big = [("w", "float32", (350 << 8,))]                      # 350 KiB
    other = [("x", "float32", (100 << 10,))]                   # 400 KiB
    with ipcpool.connect(b.socket_dir) as c:
        base = used(c)
        for k in (1, 2, 3):                                    # v3 in v1's memory, v2 the spare: 700 of 1024 KiB
            publish(c, k, big)
        assert spare(c) == 350 << 10 and used(c) - base == 700 << 10
        with c.new_version("n", other) as w:                   # only with the spare's memory
            w.publish()
        assert spare(c) == 0 and used(c) - base == 750 << 10
        with c.attach("m", kind="numpy") as ck:
            assert ck.version == 3 and all((t == 3).all() for t in ck.tensors.values())
        with pytest.raises(ipcpool.OutOfMemory, match="max_size"):
            c.new_version("x", other)                          # nothing more to take back: refused
        for name in ("m", "n"):
            c.delete_checkpoint(name)
        assert used(c) == base
