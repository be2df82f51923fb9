"""Edges a user meets through the API: a wait that says what it waits for, errors that are also
the built-in exceptions they are, a dtype numpy lacks."""

import logging
import pickle
import threading
import time

import numpy as np
import pytest

import ipcpool
from ipcpool._client import waitlog


@pytest.mark.parametrize("created", [False, True], ids=["before the create", "before the seal"])
def test_a_get_without_timeout_says_once_which_name_it_waits_for(broker, monkeypatch, caplog, created):
    """Asleep for the create (the broker wakes it), or for the seal (on the object's board word)."""
    monkeypatch.setattr(waitlog, "LOG_AFTER_S", 0.2)
    caplog.set_level(logging.WARNING, logger="ipcpool")
    got = []
    with ipcpool.connect(broker.socket_dir) as reader, ipcpool.connect(broker.socket_dir) as writer:
        buf = writer.create("late/x", 4096, pool="default") if created else None
        writer.flush()
        t = threading.Thread(target=lambda: got.append(bytes(reader.get("late/x").view[:2])))
        t.start()
        deadline = time.monotonic() + 10
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)   # a second interval passes: still one line
        buf = buf or writer.create("late/x", 4096, pool="default")
        buf.view[:2] = b"ok"
        buf.seal()
        t.join(10)
        assert got == [b"ok"]
    lines = [r.getMessage() for r in caplog.records if r.name == "ipcpool._client.waitlog"]
    assert len(lines) == 1, lines
    assert lines[0].startswith("still waiting for object 'late/x' to be sealed (get) after 0 s"), lines[0]


def test_errors_are_also_the_builtin_exceptions_they_are(broker, tmp_path):
    with pytest.raises(ConnectionError, match="no broker is serving"):
        ipcpool.connect(tmp_path, timeout=1)
    with ipcpool.connect(broker.socket_dir) as c:
        with pytest.raises(TimeoutError, match="'never/x'"):
            c.get("never/x", timeout=0.05)
        with pytest.raises(LookupError) as info:
            c.delete("never/x")
    assert isinstance(info.value, ipcpool.ObjectNotFound) and isinstance(info.value, ValueError)
    for cls in (ipcpool.BrokerGone, ipcpool.WaitTimeout, ipcpool.ObjectNotFound):   # still pickle as themselves
        err = pickle.loads(pickle.dumps(cls("m")))
        assert type(err) is cls and str(err) == "m" and err.code == cls.code


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_get_array_of_a_dtype_numpy_lacks_says_what_to_use(broker, dtype):
    with ipcpool.connect(broker.socket_dir) as c:
        with c.create(f"w/{dtype}", 8, meta={"dtype": dtype, "shape": [8 // (2 if dtype == "bfloat16" else 1)]}) as buf:
            buf.seal()
        try:
            import ml_dtypes   # noqa: F401
        except ModuleNotFoundError:
            with pytest.raises(ipcpool.MissingDependency, match=f"numpy has no dtype '{dtype}': pip install ml_dtypes"):
                c.get_array(f"w/{dtype}")
            with pytest.raises(ipcpool.MissingDependency, match="get_tensor"):
                c.get_arrays([f"w/{dtype}"])
        else:   # numpy reads it through ml_dtypes
            assert c.get_array(f"w/{dtype}").dtype.name == dtype
            c.release_all(f"w/{dtype}")
        assert c.list(f"w/{dtype}")[0]["leases"] == 0   # nothing held after the refusal
