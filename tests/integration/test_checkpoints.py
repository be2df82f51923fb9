"""Checkpoints on the host backend: versions published whole, attach, refresh, holders, death."""

import ctypes
import json
import os
import random
import signal
import struct
import time

import numpy as np
import pytest

import ipcpool
from tests.support.procs import SPAWN, run_procs
from tests.support.safetensors import sample_tensors as _tensors
from tests.support.safetensors import write_safetensors


def used(c):
    return c.stats()["pools"]["default"]["used"]


SPECS = [("embed", "float32", (64, 32)), ("layer.0.w", "float16", (32, 32)), ("layer.0.b", "float32", (32,)),
         ("steps", "int64", ()), ("empty", "float32", (0, 4))]


def write_version(c, name, value, specs=SPECS, **kw):
    with c.new_version(name, specs, **kw) as w:
        for t in w.tensors("numpy").values():
            t[...] = value
        return w.publish()


def test_publish_attach_refresh_and_release(broker):
    with ipcpool.connect(broker.socket_dir) as w, ipcpool.connect(broker.socket_dir) as r:
        base = used(w)
        v1 = write_version(w, "model", 1, user={"step": 1})
        ck = r.attach("model", kind="numpy")
        assert ck.version == v1 == 1 and ck.user == {"step": 1}
        assert sorted(ck.tensors) == sorted(n for n, _, _ in SPECS)
        assert ck.tensors["embed"].shape == (64, 32) and ck.tensors["embed"].dtype == np.float32
        assert ck.tensors["layer.0.w"].dtype == np.float16 and ck.tensors["steps"].shape == ()
        assert all((t == 1).all() for t in ck.tensors.values())
        assert not ck.tensors["embed"].flags.writeable
        assert ck.refresh() is False                       # nothing newer: one round trip
        v2 = write_version(w, "model", 2)
        (info,) = w.list_checkpoints()
        assert info["current"] == v2 == 2
        assert [(v["version"], v["state"], v["holders"]) for v in info["versions"]] == [(1, "retired", 1), (2, "current", 0)]
        old = ck.tensors["embed"]
        assert (old == 1).all()                            # held: replaced, not freed
        del old
        assert ck.refresh() is True and ck.version == 2
        assert all((t == 2).all() for t in ck.tensors.values())
        (info,) = r.list_checkpoints()                     # (after r's releases: one session's order)
        assert [(v["version"], v["state"], v["holders"]) for v in info["versions"]] == [(2, "current", 1)]
        ck.release()
        ck.release()                                       # idempotent
        r.delete_checkpoint("model")
        assert r.list_checkpoints() == [] and used(r) == base


def test_a_fixed_version_and_errors(broker):
    with ipcpool.connect(broker.socket_dir) as c:
        with pytest.raises(ipcpool.ObjectNotFound, match="no checkpoint named 'nope'"):
            c.attach("nope", kind="numpy")
        with pytest.raises(ipcpool.WaitTimeout, match="not published within 0.05 s"):
            c.attach("nope", kind="numpy", timeout=0.05)
        write_version(c, "m", 1)
        with c.attach("m", kind="numpy") as held:
            write_version(c, "m", 2)
            with c.attach("m", version=1, kind="numpy") as again:   # alive while held: attachable
                assert again.version == 1 and (again.tensors["embed"] == 1).all()
            assert held.version == 1
        with pytest.raises(ipcpool.ObjectNotFound, match=r"no version 1 \(alive: \[2\]\)"):
            c.attach("m", version=1, kind="numpy")
        with pytest.raises(ipcpool.InvalidRequest, match="dtype 'float 8'"):
            c.new_version("m", [("x", "float 8", (1,))])
        w = c.new_version("m", SPECS)
        w.abort()
        with pytest.raises(ipcpool.ClosedError, match="published or aborted"):
            w.publish()
        assert [v["version"] for v in c.list_checkpoints()[0]["versions"]] == [2]


def test_bad_manifests_are_refused_by_the_broker(broker):
    with ipcpool.connect(broker.socket_dir) as c:
        ch = c._channel
        r = ch.call("ckpt_begin", name="raw", shards=[1024], count=2, pool="default")
        v = r["version"]
        cases = [
            ([["a", "float32", [4], 0, 1020, 16]], "do not fit in shard 0"),
            ([["a", "float32", [4], 1, 0, 16]], "do not fit in shard 1"),
            ([["a", "float32", [4], 0, 0, 12]], "is float32 \\[4\\], not 12 bytes"),
            ([["a", "float32", [4], 0, 2, 16]], "not aligned"),
            ([["a", "float33", [4], 0, 0, 16]], "dtype 'float33' is not one of"),
            ([["a", "float32", [4], 0]], "\\[name, dtype, shape, shard, offset, nbytes\\]"),
            ([["", "float32", [4], 0, 0, 16]], "a tensor name is"),
            ([["a", "float32", [4], 0, 0, 16], ["a", "float32", [4], 0, 16, 16]], "'a' named twice"),
            ([["a", "float32", [4], 0, 0, 16]] * 3, "more than the 2 tensors declared"),
        ]
        for entries, message in cases:
            with pytest.raises(ipcpool.InvalidRequest, match=message):
                ch.call("ckpt_add", name="raw", version=v, entries=entries)
        ch.call("ckpt_add", name="raw", version=v, entries=[["a", "float32", [4], 0, 0, 16]])
        with pytest.raises(ipcpool.InvalidRequest, match="has 1 of its 2 tensors"):
            ch.call("ckpt_publish", name="raw", version=v)
        ch.call("ckpt_add", name="raw", version=v, entries=[["b", "float32", [4], 0, 8, 16]])
        with pytest.raises(ipcpool.InvalidRequest, match="'a' and 'b' overlap"):
            ch.call("ckpt_publish", name="raw", version=v)
        with pytest.raises(ipcpool.InvalidRequest, match="no version 99 this session is writing"):
            ch.call("ckpt_publish", name="raw", version=99)
        with pytest.raises(ipcpool.InvalidRequest, match="keep names shards 0 to 0 only"):
            ch.call("ckpt_publish", name="raw", version=v, keep=[1])
        with pytest.raises(ipcpool.InvalidRequest, match="a shard index"):
            ch.call("ckpt_publish", name="raw", version=v, keep=[-1])
        ch.send("ckpt_unkeep", allocs=[r["shards"][0]["alloc"], 1 << 40])   # one way; not kept: ignored
        with pytest.raises(ipcpool.ProtocolError, match="shards"):
            ch.call("ckpt_begin", name="raw", shards="x", count=1, pool="default")
        with pytest.raises(ipcpool.InvalidRequest, match="positive sizes"):
            ch.call("ckpt_begin", name="raw", shards=[0], count=1, pool="default")
        ch.call("ckpt_abort", name="raw", version=v)
        assert c.list_checkpoints() == []
        assert c.stats()["checkpoints"] == {"checkpoints": 0, "versions": 0, "version_bytes": 0, "spare_bytes": 0,
                                            "kept_bytes": 0}


def test_manifest_in_pages_and_many_shards(broker):
    specs = [(f"t{i:05d}", "float32", (3,)) for i in range(2500)]
    with ipcpool.connect(broker.socket_dir) as c:
        with c.new_version("big", specs, shard_bytes=64 << 10) as w:
            for i, (n, t) in enumerate(w.tensors("numpy").items()):
                t[:] = i
            w.publish()
        assert c.list_checkpoints()[0]["versions"][0]["shards"] > 1
        with c.attach("big", kind="numpy") as ck:
            assert len(ck.tensors) == 2500
            assert all(ck.tensors[f"t{i:05d}"][2] == i for i in range(2500))


def test_a_writer_that_dies_leaves_nothing(broker):
    with ipcpool.connect(broker.socket_dir) as c:
        base = used(c)
        p = SPAWN.Process(target=_write_and_hang, args=(str(broker.socket_dir),))
        p.start()
        deadline = time.monotonic() + 30
        while not c.list_checkpoints() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.list_checkpoints()[0]["versions"][0]["state"] == "writing"
        with pytest.raises(ipcpool.ObjectNotFound, match="no published version yet"):
            c.attach("dying", kind="numpy")
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        deadline = time.monotonic() + 10
        while c.list_checkpoints() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.list_checkpoints() == [] and used(c) == base


def _write_and_hang(socket_dir):
    c = ipcpool.connect(socket_dir)
    w = c.new_version("dying", SPECS)
    w.tensors("numpy")["embed"][:] = 5
    time.sleep(60)


# -- a reader never sees part of a checkpoint -----------------------------------------------------
def _publisher(socket_dir, start, q):
    """Publish versions in a loop; each tensor of version v holds v everywhere."""
    with ipcpool.connect(socket_dir) as c:
        q.put(("ready", os.getpid()))
        specs = [(f"w{i}", "int32", (1 << 14,)) for i in range(40)]
        v = start
        while True:
            with c.new_version("swap", specs, shard_bytes=1 << 20, user={"stamp": v}) as w:
                stamp = w.version
                for t in w.tensors("numpy").values():
                    t[:] = stamp
                    time.sleep(0.0002)                  # room to be killed half-way
                w.publish()
            v += 1


def _reader(socket_dir, seconds, q):
    seen, mixed = set(), 0
    with ipcpool.connect(socket_dir) as c:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                with c.attach("swap", kind="numpy") as ck:
                    vals = {int(t[0]) for t in ck.tensors.values()} | {int(t[-1]) for t in ck.tensors.values()}
                    if vals != {ck.version}:
                        mixed += 1
                    seen.add(ck.version)
            except ipcpool.ObjectNotFound as exc:
                assert "swap" in str(exc)
    q.put((sorted(seen), mixed))


def test_readers_never_see_a_mix_while_writers_are_killed(broker):
    rng = random.Random(34)
    sd = str(broker.socket_dir)
    with ipcpool.connect(sd) as c:
        base = used(c)
        q = SPAWN.Queue()
        readers = [SPAWN.Process(target=_reader, args=(sd, 6.0, q)) for _ in range(2)]
        for r in readers:
            r.start()
        kills = 0
        end = time.monotonic() + 5.0
        while time.monotonic() < end:
            p = SPAWN.Process(target=_publisher, args=(sd, 0, q))
            p.start()
            assert q.get(timeout=30)[0] == "ready"
            time.sleep(rng.uniform(0.005, 0.3))
            os.kill(p.pid, signal.SIGKILL)
            p.join()
            kills += 1
        results = [q.get(timeout=30) for _ in readers]
        for r in readers:
            r.join()
        assert kills >= 5
        assert all(mixed == 0 for _, mixed in results), results
        assert any(len(seen) > 1 for seen, _ in results), results
        deadline = time.monotonic() + 10
        while any(v["state"] == "writing" for ck in c.list_checkpoints() for v in ck["versions"]):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        (info,) = c.list_checkpoints()
        assert [v["state"] for v in info["versions"]] == ["current"]
        c.delete_checkpoint("swap")
        assert used(c) == base


# -- one loader elected -----------------------------------------------------------------------------
def _load_or_attach(socket_dir, path, q):
    with ipcpool.connect(socket_dir) as c:
        with c.load_or_attach("shared", path, kind="numpy", timeout=30) as ck:
            q.put((ck.version, {k: v.copy() for k, v in ck.tensors.items()}))


def test_load_or_attach_elects_one_loader(broker, tmp_path):
    path = tmp_path / "m.safetensors"
    write_safetensors(path, _tensors())
    results = run_procs(_load_or_attach, [(str(broker.socket_dir), str(path))] * 4)
    assert {v for v, _ in results} == {1}                 # one version: one loader
    for _, got in results:
        assert all(np.array_equal(got[k], v) for k, v in _tensors().items())


def test_a_sharded_directory_loads_as_one_checkpoint(broker, tmp_path):
    t = _tensors()
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a.weight": t["a.weight"]})
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"a.bias": t["a.bias"], "count": t["count"]})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a.weight": "model-00001-of-00002.safetensors", "a.bias": "model-00002-of-00002.safetensors",
        "count": "model-00002-of-00002.safetensors"}}))
    with ipcpool.connect(broker.socket_dir) as c:
        assert c.load_checkpoint("dir", tmp_path, progress=False) == 1
        with c.attach("dir", kind="numpy") as ck:
            assert all(np.array_equal(ck.tensors[k], v) for k, v in t.items())


def _elected_then_killed(socket_dir, path, q):
    """Load like load_or_attach, but die once elected, before publishing."""
    from ipcpool._client.checkpoints import VersionWriter
    from ipcpool.weights.load import layout_of
    from ipcpool.weights.sources import read_source

    c = ipcpool.connect(socket_dir)
    shards, entries = layout_of(read_source(path), 1 << 30)
    got = c._checkpoints.begin("shared", shards, entries, pool="default", user=None, exclusive=True, stream=None)
    q.put(isinstance(got, VersionWriter))
    time.sleep(60)


def test_the_elected_loader_dies_and_the_next_caller_loads(broker, tmp_path):
    path = tmp_path / "m.safetensors"
    write_safetensors(path, _tensors(1))
    sd = str(broker.socket_dir)
    q = SPAWN.Queue()
    dying = SPAWN.Process(target=_elected_then_killed, args=(sd, str(path), q))
    dying.start()
    assert q.get(timeout=30) is True
    waiter = SPAWN.Process(target=_load_or_attach, args=(sd, str(path), q))
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive() and q.empty()                 # waiting for the elected loader
    os.kill(dying.pid, signal.SIGKILL)
    dying.join()
    version, got = q.get(timeout=30)
    waiter.join(10)
    assert version == 2                                    # version 1 died unpublished
    assert all(np.array_equal(got[k], v) for k, v in _tensors(1).items())


def test_load_or_attach_times_out_naming_the_loader(broker, tmp_path):
    path = tmp_path / "m.safetensors"
    write_safetensors(path, _tensors())
    sd = str(broker.socket_dir)
    q = SPAWN.Queue()
    dying = SPAWN.Process(target=_elected_then_killed, args=(sd, str(path), q))
    dying.start()
    try:
        assert q.get(timeout=30) is True
        with ipcpool.connect(sd) as c:
            with pytest.raises(ipcpool.WaitTimeout, match="another process is loading it"):
                c.load_or_attach("shared", path, kind="numpy", timeout=0.2)
    finally:
        dying.kill()
        dying.join()


def test_cli_load_ls_rm_a_checkpoint(broker, tmp_path):
    from tests.integration.test_cli import ipcpool_cmd

    path = tmp_path / "tiny.safetensors"
    write_safetensors(path, _tensors())
    sd = str(broker.socket_dir)
    out = ipcpool_cmd("load", str(path), "--socket-dir", sd)
    assert out.returncode == 0, out.stderr
    assert "loaded 3 tensor(s)" in out.stdout and "as checkpoint 'tiny' version 1" in out.stdout
    listed = json.loads(ipcpool_cmd("ls", "--json", "--socket-dir", sd).stdout)["checkpoints"]
    assert [(c["name"], c["current"], c["versions"][0]["tensors"]) for c in listed] == [("tiny", 1, 3)]
    assert "tiny" in ipcpool_cmd("ls", "--socket-dir", sd).stdout
    assert ipcpool_cmd("rm", "tiny", "--socket-dir", sd).returncode == 0
    assert json.loads(ipcpool_cmd("ls", "--json", "--socket-dir", sd).stdout)["checkpoints"] == []


def test_a_version_laid_out_like_another_copies_shard_for_shard(broker):
    """What a pull from a peer broker does (issue 35): the same layout, bytes copied per shard."""
    with ipcpool.connect(broker.socket_dir) as c:
        write_version(c, "src", 7, shard_bytes=4096)
        with c.attach("src", kind="numpy") as src:
            with c.new_version_like("dst", src.shard_sizes, src.entries, user={"from": "src"}) as w:
                assert [size for _, size, _ in w.ranges()] == src.shard_sizes
                for mine, theirs in zip(w.shards, src.ranges()):
                    mine.view[:] = memoryview((ctypes.c_ubyte * theirs[1]).from_address(theirs[0])).cast("B")
                w.publish()
        with c.attach("dst", kind="numpy") as ck:
            assert ck.user == {"from": "src"} and all((t == 7).all() for t in ck.tensors.values())
