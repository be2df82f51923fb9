"""A CUDA client pool's batch import, as pure logic: the driver calls are stand-ins here (the GPU
suite exercises the real ones)."""

import contextlib

import pytest

client_pool = pytest.importorskip("ipcpool.backend.cuda.client_pool", exc_type=ImportError)

from ipcpool.backend.base import Export  # noqa: E402
from ipcpool.errors import IpcPoolError  # noqa: E402


class FakeStream:
    def __init__(self, steps):
        self.steps = steps

    def sync(self):
        self.steps.append("sync")


class FakeBuffer:
    def __init__(self, ptr, steps):
        self.handle, self.steps = ptr, steps

    def close(self, stream=None):
        self.steps.append(f"free {self.handle:#x}")


class Services:
    event_spin_s = 0.0

    def __init__(self, steps):
        self.steps = steps

    def stream(self, obj, device):
        return FakeStream(self.steps)

    def keep_done(self, event):
        self.steps.append("keep_done")


def test_a_failed_batch_import_frees_what_it_imported_before_the_leases_go_back(monkeypatch):
    steps = []
    imported = iter([0x1000, None])

    def import_pointer(mr, data, size):
        ptr = next(imported)
        if ptr is None:
            exc = IpcPoolError("cuMemPoolImportPointer failed: CUDA_ERROR_INVALID_VALUE")
            exc.cuda_result = 1   # as errors.check marks a failed driver call
            raise exc
        return FakeBuffer(ptr, steps)

    monkeypatch.setattr(client_pool, "import_pointer", import_pointer)
    monkeypatch.setattr(client_pool, "OnDevice", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(client_pool, "record_ipc", lambda s: pytest.fail("a done event nobody will wait on"))
    pool = client_pool.CudaClientPool.__new__(client_pool.CudaClientPool)
    pool._backend, pool._mr, pool.name, pool.device = Services(steps), None, "p", 0
    pool.slab_size, pool._slabs, pool._closed = 1 << 20, {}, False
    exports = [Export(size=4096, data=bytes(64)), Export(size=4096, data=bytes(range(64)))]
    with pytest.raises(IpcPoolError, match="importing 2 allocations"):
        pool.import_many(exports)
    assert steps == ["free 0x1000", "sync"]   # freed, and the free complete, before raising
