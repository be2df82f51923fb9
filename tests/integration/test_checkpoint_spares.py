"""A swapped checkpoint's spare on the host backend: the version replaced last is written again
once no reader holds it; a held version is never touched; memory stays at two versions; a pool
short of memory takes the spare back. A writer that keeps its shards imported (as CUDA keeps VMM
mappings; forced here) imports the spare no more, keeps only what may come back, and lets go of it
when it deletes, runs short, closes or dies."""

import os
import signal
import time

import pytest

import ipcpool
from tests.support.cli import ipcpool_cmd
from tests.support.procs import SPAWN

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


def kept(c):
    return c.stats()["checkpoints"]["kept_bytes"]


def used_settled(c, want, timeout=10.0):
    """``used(c)`` once it is ``want`` or ``timeout`` has passed: a session that closes or dies is
    the broker's a moment later than the next request of another session."""
    deadline = time.monotonic() + timeout
    while (now := used(c)) != want and time.monotonic() < deadline:
        time.sleep(0.01)
    return now


# A writer that keeps its shards imported (CUDA: VMM mappings; forced here on the host: there an
# import costs nothing, so the host pool keeps nothing unless a test asks).
def _keep_all(self, memory, stream=None, credit=b""):
    return b"", None


def _keep_on_host():
    """In a process of its own: the host pool keeps every import a writer publishes."""
    from ipcpool.backend.host.client import HostClientPool

    HostClientPool.keep = _keep_all


@pytest.fixture
def keeping(monkeypatch):
    from ipcpool.backend.host.client import HostClientPool

    monkeypatch.setattr(HostClientPool, "keep", _keep_all, raising=False)


@pytest.fixture(params=[False, True], ids=["imports", "keeps"])
def keeps(request):
    """Both kinds of writer: one that imports its shards at each version, one that keeps them."""
    if request.param:
        request.getfixturevalue("keeping")
    return request.param


def count_imports(monkeypatch, client):
    """The imports ``client`` makes one by one (a writer's shards at begin), counted."""
    from ipcpool._client.pools import Pools

    seen = []
    real = Pools.import_allocation

    def counted(self, aid, *args, **kw):
        if self is client._pools:
            seen.append(aid)
        return real(self, aid, *args, **kw)

    monkeypatch.setattr(Pools, "import_allocation", counted)
    return seen


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


def test_a_swap_loop_stays_at_two_versions(broker, keeps, monkeypatch):
    with ipcpool.connect(broker.socket_dir) as w, ipcpool.connect(broker.socket_dir) as r:
        imports = count_imports(monkeypatch, w)
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
            assert all((t == k).all() for t in ck.tensors.values())   # whole, never a mix
            r.stats()   # a round trip: r's release of the old version is the broker's before the next publish
            assert kept(w) == 0                                 # what it keeps is current or the spare
            assert len(w._checkpoints._kept) == (2 if keeps else 0)   # this version's shard and the spare's
        # Kept: versions 0 and 1 in fresh memory, each imported once; every later one in the spare.
        assert len(imports) == (2 if keeps else 7), imports
        high = w.stats()["pools"]["default"]["used_high"]
        assert high - base <= 2 * one, (high - base, one)      # the bound, from the pool's own high mark
        assert len(addresses) == 2                             # two regions, written in turn
        ck.release()
        r.stats()                                              # (r's release is the broker's before w deletes)
        w.delete_checkpoint("m")                               # a writer lets go of what it keeps
        assert w._checkpoints._kept == {} and used(w) == base


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


def test_a_pool_short_of_memory_takes_the_spare_back(start_broker, keeps):
    b = start_broker(config_text='[[pools]]\nname = "default"\nmax_size = "1M"\n')
    big = [("w", "float32", (350 << 8,))]                      # 350 KiB
    other = [("x", "float32", (100 << 10,))]                   # 400 KiB
    with ipcpool.connect(b.socket_dir) as c:
        base = used(c)
        for k in (1, 2, 3):                                    # v3 in v1's memory, v2 the spare: 700 of 1024 KiB
            publish(c, k, big)
        assert spare(c) == 350 << 10 and used(c) - base == 700 << 10
        with c.new_version("n", other) as w:                   # only with the spare's memory (kept: let go first)
            w.publish()
        assert spare(c) == 0 and used(c) - base == 750 << 10
        with c.attach("m", kind="numpy") as ck:
            assert ck.version == 3 and all((t == 3).all() for t in ck.tensors.values())
        with pytest.raises(ipcpool.OutOfMemory, match="max_size"):
            c.new_version("x", other)                          # nothing more to take back: refused
        for name in ("m", "n"):
            c.delete_checkpoint(name)
        assert used(c) == base


def test_a_kept_spare_a_reader_holds_is_never_written_and_is_let_go(broker, keeping, monkeypatch):
    with ipcpool.connect(broker.socket_dir) as w, ipcpool.connect(broker.socket_dir) as r:
        imports = count_imports(monkeypatch, w)
        base = used(w)
        _, at1 = publish(w, 1)
        one = used(w) - base
        held = r.attach("m", kind="numpy")
        _, at2 = publish(w, 2)                                 # v1 is the spare, but r holds it
        _, at3 = publish(w, 3)                                 # so fresh memory; v1 let go by w
        assert at3 not in (at1, at2) and len(imports) == 3
        assert {k.version for k in w._checkpoints._kept.values()} == {2, 3}
        _, at4 = publish(w, 4)                                 # into v2's memory, kept: no import
        assert at4 == at2 and len(imports) == 3
        assert held.version == 1 and all((t == 1).all() for t in held.tensors.values())
        assert used(w) - base == 3 * one and kept(w) == 0
        held.release()
        assert used(r) - base == 2 * one                       # v1 freed: nothing keeps it
        r.delete_checkpoint("m")                               # by another session: w still keeps
        assert kept(r) == used(r) - base == 2 * one            # ... which stats show as kept_bytes
    with ipcpool.connect(broker.socket_dir) as c:
        assert used_settled(c, base) == base and kept(c) == 0  # gone with w's close


def test_loaders_keep_nothing(broker, keeping, tmp_path):
    np = pytest.importorskip("numpy")
    from tests.support.safetensors import write_safetensors

    path = tmp_path / "m.safetensors"
    write_safetensors(path, {"a": np.arange(64, dtype=np.float32)})
    with ipcpool.connect(broker.socket_dir) as c:
        c.load_checkpoint("m", path, progress=False)
        assert c._checkpoints._kept == {}
        publish(c, 1, [("a", "float32", (64,))])
        assert len(c._checkpoints._kept) == 1
        c.delete_checkpoint("m")


def _keep_and_wait(socket_dir, q):
    _keep_on_host()
    c = ipcpool.connect(socket_dir)
    publish(c, 1)
    publish(c, 2)
    q.put(len(c._checkpoints._kept))
    time.sleep(60)


def test_a_killed_writer_lets_go_of_what_it_kept(broker):
    with ipcpool.connect(broker.socket_dir) as c:
        base = used(c)
        q = SPAWN.Queue()
        p = SPAWN.Process(target=_keep_and_wait, args=(str(broker.socket_dir), q))
        p.start()
        assert q.get(timeout=60) == 2
        one = spare(c)
        c.delete_checkpoint("m")
        assert kept(c) == used(c) - base == 2 * one            # only the writer's kept imports hold them
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        assert used_settled(c, base) == base and kept(c) == 0


def _publish_where(c, value):
    """Publish as ``publish``; the allocation ids of its shards (two clients map a pool at different addresses)."""
    with c.new_version("m", SPECS) as w:
        aids = [b.alloc_id for b in w.shards]
        for t in w.tensors("numpy").values():
            t[...] = value
        w.publish()
        return aids


def test_another_writer_may_write_a_spare_one_keeps(broker, keeping):
    with ipcpool.connect(broker.socket_dir) as a, ipcpool.connect(broker.socket_dir) as b:
        base = used(a)
        in1 = _publish_where(a, 1)
        one = used(a) - base
        in2 = _publish_where(a, 2)                             # a keeps both: v1 is the spare
        in3 = _publish_where(b, 3)                             # b takes it: a's mapping is idle (b keeps it too)
        assert in3 == in1 and used(a) - base == 2 * one
        with b.attach("m", kind="numpy") as ck:
            assert ck.version == 3 and all((t == 3).all() for t in ck.tensors.values())
        in4 = _publish_where(a, 4)                             # into v2's memory, still a's
        assert in4 == in2 and used(a) - base == 2 * one and kept(a) == 0
        with b.attach("m", kind="numpy") as ck:
            assert ck.version == 4 and all((t == 4).all() for t in ck.tensors.values())
        a.delete_checkpoint("m")                               # a lets go; b still keeps v3's memory
        assert kept(a) == used(a) - base == one
        b.close()
        assert used_settled(a, base) == base
