"""`ipcpool load`, `ls` and `rm` against a real broker."""

import json

import numpy as np
import pytest

import ipcpool
from tests.support.cli import ipcpool_cmd, table_rows

safetensors_numpy = pytest.importorskip("safetensors.numpy")


def test_load_ls_rm(broker, tmp_path):
    tensors = {
        "embed.weight": np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32),
        "layer0.bias": np.arange(7, dtype=np.int64),
        "empty": np.zeros((0, 3), dtype=np.float16),
    }
    path = tmp_path / "m.safetensors"
    safetensors_numpy.save_file(tensors, str(path), metadata={"format": "np"})
    sd = str(broker.socket_dir)

    out = ipcpool_cmd("load", str(path), "--prefix", "m/", "--socket-dir", sd)
    assert out.returncode == 0, out.stderr
    assert "loaded 3 tensor(s)" in out.stdout
    # stderr is a pipe here: plain lines, no terminal frames
    assert "\r" not in out.stderr and "\x1b" not in out.stderr
    assert out.stderr.splitlines()[-1].startswith("loading m.safetensors: 8.1 KiB of 8.1 KiB in ")

    with ipcpool.connect(sd) as c:
        for name, ref in tensors.items():
            got = c.get_array("m/" + name)
            assert got.dtype == ref.dtype and got.shape == ref.shape and np.array_equal(got, ref)
            assert c.release_all("m/" + name) == 1
        assert c.list("m/embed")[0]["meta"]["user"] == {"format": "np"}

    table = table_rows(ipcpool_cmd("ls", "m/", "--socket-dir", sd).stdout)
    assert table[0] == ["NAME", "SIZE", "DTYPE", "SHAPE", "STATE", "LEASES"]
    assert table[1] == ["m/embed.weight", "8.0", "KiB", "float32", "64x32", "sealed", "0"]
    assert table[-1][:2] == ["3", "object(s),"]
    listed = json.loads(ipcpool_cmd("ls", "--json", "--socket-dir", sd).stdout)
    assert sorted(o["name"] for o in listed["objects"]) == ["m/embed.weight", "m/empty", "m/layer0.bias"]

    with ipcpool.connect(sd) as c:
        c.create_growable("m/kv", 3 << 20).close()
        table = table_rows(ipcpool_cmd("ls", "m/", "--socket-dir", sd).stdout)
        assert table[-3] == ["GROWABLE", "SIZE", "CHUNKS", "POOL", "STATE", "ATTACHED"]
        assert table[-2] == ["m/kv", "3.0", "MiB", "1", "default", "live", "0"]
        assert table[-1][:3] == ["1", "growable", "buffer(s),"]

    rm = ipcpool_cmd("rm", "m/empty", "m/nope", "m/kv", "--socket-dir", sd)
    assert rm.returncode == 1 and "m/nope: no object, growable buffer or checkpoint named 'm/nope'" in rm.stderr
    listed = json.loads(ipcpool_cmd("ls", "--json", "--socket-dir", sd).stdout)
    assert [o["name"] for o in listed["objects"]] == ["m/embed.weight", "m/layer0.bias"]
    assert listed["growables"] == []


def test_load_refuses_a_broken_file(broker, tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 8 + b"{}")
    out = ipcpool_cmd("load", str(bad), "--socket-dir", str(broker.socket_dir))
    assert out.returncode == 2 and "header length" in out.stderr
    with ipcpool.connect(broker.socket_dir) as c:
        assert c.list() == []


def test_load_on_a_terminal_draws_a_bar(broker, tmp_path):
    from tests.support.cli import on_a_terminal

    path = tmp_path / "t.safetensors"
    safetensors_numpy.save_file({"x": np.ones(1 << 16, dtype=np.float32)}, str(path))
    code, shown = on_a_terminal("load", str(path), "--socket-dir", str(broker.socket_dir))
    assert code == 0 and "loaded 1 tensor(s)" in shown
    assert "t.safetensors" in shown and "256.0/256.0 KiB" in shown and "\x1b[" in shown   # rich's bar
