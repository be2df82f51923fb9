"""Sizes and lists (issue 12, item 4): huge growables get a clear error, growables count against
their pool's max_size and show in its stats, and lists of any length reach the client."""

import pytest

import ipcpool

MiB = 1 << 20
POOL_64M = '[[pools]]\nname = "default"\nmax_size = "64M"\n'


@pytest.mark.parametrize("nbytes", [2**63, 2**64 - 1, 2**62])
def test_a_huge_growable_is_a_clear_error(broker, nbytes):
    with ipcpool.connect(broker.socket_dir) as c:
        with pytest.raises(ipcpool.InvalidRequest, match="too large") as err:
            c.create_growable("g", nbytes)
        assert "internal" not in str(err.value)
        with c.create_growable("g", MiB) as g:
            with pytest.raises(ipcpool.InvalidRequest, match="too large"):
                g.grow(2**63)
            assert g.size == MiB


def test_growables_respect_the_pools_max_size_and_show_in_its_stats(start_broker):
    b = start_broker(config_text=POOL_64M)
    with ipcpool.connect(b.socket_dir, arena_bytes=0) as c:
        with pytest.raises(ipcpool.OutOfMemory, match="max_size of 67108864"):
            c.create_growable("big", 65 * MiB)
        buf = c.allocate(16 * MiB)
        g = c.create_growable("g", 32 * MiB)
        row = c.stats()["pools"]["default"]
        assert (row["growables"], row["growable_bytes"], row["used"]) == (1, 32 * MiB, 16 * MiB)
        with pytest.raises(ipcpool.OutOfMemory, match="max_size"):
            g.grow(49 * MiB)                 # 16 + 49 > 64
        g.grow(48 * MiB)                     # 16 + 48 = 64: fits exactly
        with pytest.raises(ipcpool.OutOfMemory, match="max_size"):
            c.create_growable("g2", MiB)
        buf.free()
        c.create_growable("g2", 16 * MiB).close()
        c.delete_growable("g2")
        g.close()
        c.delete_growable("g")
        row = c.stats()["pools"]["default"]
        assert (row["growables"], row["growable_bytes"], row["used"]) == (0, 0, 0)


def test_lists_and_subscriptions_page_past_a_thousand_objects(broker):
    import json
    import subprocess
    import sys

    import numpy as np

    n = 2500
    with ipcpool.connect(broker.socket_dir) as c:
        for i in range(n):
            buf = c.create(f"many/{i:05d}", 64, meta={"dtype": "uint8", "shape": [64]})
            np.asarray(buf)[:] = i % 256
            buf.seal()
            buf.free()
        c.create("many/zz-unsealed", 64)
        listed = c.list("many/")
        assert [o["name"] for o in listed] == [f"many/{i:05d}" for i in range(n)] + ["many/zz-unsealed"]
        with c.subscribe("many/", existing=True) as sub:
            got = [sub.next(timeout=1)["name"] for _ in range(n)]
            assert got == [f"many/{i:05d}" for i in range(n)]    # sealed ones only, each once
            c.put_tensor("many/new", np.arange(3))
            assert sub.next(timeout=5)["name"] == "many/new"
            assert sub.next(timeout=0.2) is None
    out = subprocess.run([sys.executable, "-m", "ipcpool", "ls", "many/", "--json", "--socket-dir",
                          str(broker.socket_dir)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["objects"]) == n + 1   # (the unsealed one went with its writer)


def test_growables_list_in_pages(broker, raw_session):
    from ipcpool import protocol

    _, d = raw_session
    with ipcpool.connect(broker.socket_dir) as c:
        gs = [c.create_growable(f"gl/{i}", 4096) for i in range(5)]
        assert [g["name"] for g in c.list_growables("gl/")] == [f"gl/{i}" for i in range(5)]
        names, after = [], ""
        for rid in range(1, 10):
            d.send(protocol.pack({"op": "list", "id": rid, "prefix": "gl/", "kind": "growables",
                                  "limit": 2, "after": after}))
            r = protocol.unpack(d.recv(), protocol.MAX_REPLY)
            assert r["ok"] and r["objects"] == [] and len(r["growables"]) <= 2
            names += [g["name"] for g in r["growables"]]
            if not r["more"]:
                break
            after = r["after"]
        assert names == [f"gl/{i}" for i in range(5)] and rid == 3
        for g in gs:
            g.close()


def test_stats_table_shows_growable_bytes(broker):
    import subprocess
    import sys

    with ipcpool.connect(broker.socket_dir) as c, c.create_growable("t/g", 3 * MiB):
        out = subprocess.run([sys.executable, "-m", "ipcpool", "stats", "--socket-dir", str(broker.socket_dir)],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    header = next(line for line in lines if line.split()[:1] == ["pool"])
    row = next(line for line in lines if line.split()[:1] == ["default"])
    assert "growable" in header and "3.0 MiB" in row
