"""Nothing the broker refuses is lost without a word: a create carved without a round trip and
refused later (a name that exists) is raised by ``seal()`` once known, else by ``close()`` (and
``with``), warned about by a finalizer, and reported by ``ipcpool load`` with a non-zero exit."""

import gc
import warnings

import numpy as np
import pytest

import ipcpool
from tests.support.cli import ipcpool_cmd

MiB = 1 << 20


def _stored(c: ipcpool.Client, name: str) -> bytes:
    lease = c.get(name, timeout=0)
    try:
        return bytes(lease.view)
    finally:
        lease.free()


def test_leaving_the_with_block_raises_a_refused_create(broker):
    with ipcpool.connect(broker.socket_dir) as c:
        first = c.create("m/ids", 64)
        first.write(b"o" * 64)
        first.seal()
    with pytest.raises(ipcpool.ObjectExists, match="an object named 'm/ids' already exists"):
        with ipcpool.connect(broker.socket_dir) as c:
            clash = c.create("m/ids", 64)
            assert clash.carved_at is not None          # sent without waiting for the broker
            clash.write(b"n" * 64)
            clash.seal()
    assert clash.refusal is not None and "m/ids" in str(clash.refusal)
    with ipcpool.connect(broker.socket_dir) as c:
        assert _stored(c, "m/ids") == b"o" * 64        # the old data, and the user was told


def test_close_raises_it_too_and_only_once(broker):
    with ipcpool.connect(broker.socket_dir) as c:
        c.create("x", 64).seal()
    c = ipcpool.connect(broker.socket_dir)
    c.create("x", 64).seal()
    with pytest.raises(ipcpool.ObjectExists, match="'x' already exists"):
        c.close()
    assert c.closed
    c.close()                                           # raised once: closing again is quiet
    assert [type(e) for e in c.async_errors] == [ipcpool.ObjectExists]


def test_seal_raises_a_refusal_already_known(broker):
    with ipcpool.connect(broker.socket_dir) as c:
        c.create("taken", 64).seal()
        clash = c.create("taken", 64)
        while clash.refusal is None:                    # any answered request brings the refusal
            c.stats()
        with pytest.raises(ipcpool.ObjectExists, match="'taken' already exists"):
            clash.seal()
        c.flush()                                       # raised by seal(): not again
        assert [o["name"] for o in c.list()] == ["taken"]


def test_an_error_inside_the_block_is_kept_and_the_refusal_noted(broker):
    with ipcpool.connect(broker.socket_dir) as c:
        c.create("y", 64).seal()
    with pytest.raises(KeyError) as info:
        with ipcpool.connect(broker.socket_dir) as c:
            c.create("y", 64).seal()
            raise KeyError("the user's own error")
    assert any("'y' already exists" in note for note in info.value.__notes__)


def test_a_client_collected_unclosed_warns_about_refusals(broker):
    with ipcpool.connect(broker.socket_dir) as c:
        c.create("z", 64).seal()
    c = ipcpool.connect(broker.socket_dir)
    c.create("z", 64).seal()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        del c
        gc.collect()
    texts = [str(w.message) for w in seen if w.category is RuntimeWarning]
    assert texts and "the broker refused" in texts[0] and "the first: an object named 'z' already exists" in texts[0]


@pytest.fixture
def partial_checkpoint(broker, tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    with ipcpool.connect(broker.socket_dir) as c:
        old = c.create("m/ids", 8, meta={"dtype": "int64", "shape": [1]})
        old.write(np.array([7], dtype=np.int64).tobytes())
        old.seal()
    tensors = {"ids": np.array([1], dtype=np.int64), "a": np.arange(4, dtype=np.float32),
               "b": np.ones((2, 2), dtype=np.float16)}
    path = tmp_path / "partial.safetensors"
    safetensors_numpy.save_file(tensors, str(path))
    return path


def test_load_names_every_tensor_not_stored_and_exits_non_zero(broker, partial_checkpoint):
    sd = str(broker.socket_dir)
    out = ipcpool_cmd("load", str(partial_checkpoint), "--prefix", "m/", "--socket-dir", sd)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "not stored: m/ids: an object named 'm/ids' already exists" in out.stderr
    assert "1 tensor(s) of" in out.stderr and "--overwrite" in out.stderr
    assert "loaded" not in out.stdout
    with ipcpool.connect(sd) as c:
        assert sorted(o["name"] for o in c.list("m/")) == ["m/a", "m/b", "m/ids"]   # the rest stored
        assert np.frombuffer(_stored(c, "m/ids"), dtype=np.int64).tolist() == [7]   # old data kept


def test_load_overwrite_replaces_what_exists(broker, partial_checkpoint):
    sd = str(broker.socket_dir)
    with ipcpool.connect(sd) as reader:
        held = reader.get("m/ids", timeout=0)           # a reader of the old version keeps it
        out = ipcpool_cmd("load", str(partial_checkpoint), "--prefix", "m/", "--overwrite", "--socket-dir", sd)
        assert out.returncode == 0, out.stderr
        assert "loaded 3 tensor(s)" in out.stdout
        assert np.frombuffer(bytes(held.view), dtype=np.int64).tolist() == [7]
        held.free()
        assert np.frombuffer(_stored(reader, "m/ids"), dtype=np.int64).tolist() == [1]
