import pytest

import ipcpool
from ipcpool import errors


def test_public_surface_is_explicit():
    assert sorted(ipcpool.__all__) == sorted(
        ["AllocationTooLarge", "BackendUnavailable", "BrokerBusy", "BrokerGone", "Buffer", "Checkpoint", "Client", "ClosedError",
         "InvalidRequest", "IpcPoolError", "MissingDependency", "ObjectAborted", "ObjectExists", "ObjectNotFound", "OutOfMemory",
         "PeerRefused", "ProtocolError", "QuotaExceeded", "Subscription", "UnknownPool", "VersionWriter",
         "DigestMismatch", "TransferFailed",
         "WaitTimeout", "connect"]
    )
    for name in ipcpool.__all__:
        assert getattr(ipcpool, name) is not None


def test_every_error_derives_from_root_and_has_a_unique_code():
    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.IpcPoolError)]
    assert len(classes) >= 10
    codes = [c.code for c in classes]
    assert len(set(codes)) == len(codes)
    for cls in classes:
        assert type(errors.error_from_wire(cls.code, "m")) is cls


def test_unknown_wire_code_falls_back_to_root():
    err = errors.error_from_wire(9999, "odd")
    assert type(err) is errors.IpcPoolError and str(err) == "odd"


def test_duplicate_code_is_refused():
    with pytest.raises(TypeError, match="used twice"):
        class Dup(errors.IpcPoolError):
            code = errors.OutOfMemory.code


def test_host_path_never_imports_cuda():
    import subprocess
    import sys

    code = (
        "import sys, ipcpool, ipcpool.backend.host, ipcpool.broker, ipcpool.cli;"
        "from ipcpool.backend import choose; choose('host');"
        "print(sorted(m for m in sys.modules if m.startswith('cuda')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
