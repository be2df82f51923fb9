"""Errors a user meets first name the fix: a missing optional library, a bad size."""

import sys

import numpy as np
import pytest

import ipcpool


@pytest.fixture
def no_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)   # `import torch` fails as where it is not installed


def test_tensor_without_torch_says_which_extra_to_install(broker, no_torch):
    with ipcpool.connect(broker.socket_dir) as c:
        c.put_tensor("w/a", np.arange(6, dtype=np.float32).reshape(2, 3))
        with pytest.raises(ipcpool.MissingDependency, match=r"torch is not installed: pip install 'ipcpool\[torch\]'") as err:
            c.get_tensor("w/a")
        assert "get_array()" in str(err.value)
        assert isinstance(err.value, ModuleNotFoundError) and isinstance(err.value, ipcpool.IpcPoolError)
        assert c.list("w/a")[0]["leases"] == 0           # the lease taken for the tensor was given back
        with c.create("w/b", 64, meta={"dtype": "uint8", "shape": [64]}) as buf:
            with pytest.raises(ipcpool.MissingDependency, match="ipcpool\\[torch\\]"):
                buf.tensor()
        assert np.array_equal(c.get_array("w/a"), np.arange(6, dtype=np.float32).reshape(2, 3))   # the way out


def test_allocate_zero_is_an_invalid_request_and_a_value_error(broker):
    with ipcpool.connect(broker.socket_dir) as c:
        for call in (lambda: c.allocate(0), lambda: c.create("z", 0), lambda: c.create_growable("g", -1)):
            with pytest.raises(ipcpool.InvalidRequest, match="nbytes must be a positive int") as err:
                call()
            assert isinstance(err.value, ValueError)
        assert c.stats()["pools"]["default"]["used"] == 0


def test_a_broker_that_never_answers_is_reported_after_the_timeout(tmp_path):
    """The control socket is non-blocking: a reply that does not come is waited for (poll) until
    the client's timeout, then reported, not waited for forever."""
    import socket
    import time

    from ipcpool import paths

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(tmp_path / paths.CONTROL_NAME))
    listener.listen(1)   # the kernel accepts the connection; nobody reads the hello or answers it
    try:
        t0 = time.monotonic()
        with pytest.raises(ipcpool.BrokerGone, match="did not answer within 1 s"):
            ipcpool.connect(tmp_path, timeout=1.0)
        assert 0.9 <= time.monotonic() - t0 < 5
    finally:
        listener.close()
