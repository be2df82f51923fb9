"""A CUDA client pool's batch import, as pure logic: the driver calls are stand-ins here (the GPU
suite exercises the real ones)."""

import concurrent.futures
import contextlib
import os

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

    def background(self, fn, *args):
        """The worker thread's job, run at once: its result (or failure) in a Future."""
        self.steps.append("background")
        future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args))
        except BaseException as exc:   # noqa: BLE001 (handed on through the Future, as the worker does)
            future.set_exception(exc)
        return future


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


def _pool_with_slabs(monkeypatch, steps):
    monkeypatch.setattr(client_pool, "OnDevice", lambda device: contextlib.nullcontext())
    pool = client_pool.CudaClientPool.__new__(client_pool.CudaClientPool)
    pool._backend, pool._mr, pool.name, pool.device, pool._peers = Services(steps), None, "p", 0, []
    pool.slab_size, pool._slabs, pool._closed = 1 << 20, {}, False
    return pool


VMM_SLAB = bytes(range(64))   # the key a broker gave a VMM slab


def test_only_a_vmm_slab_not_mapped_yet_takes_fds(monkeypatch):
    pool = _pool_with_slabs(monkeypatch, [])
    vmm_range = Export(size=4096, offset=8192, data=VMM_SLAB, sub=True, chunks=(1 << 20,))
    assert pool.needs_fds(vmm_range)
    assert pool.needs_fds(Export(size=8 << 30, chunks=(4 << 30, 4 << 30)))   # memory of chunks of its own
    assert not pool.needs_fds(Export(size=4096, offset=0, data=bytes(64), sub=True))   # a pool slab
    pool._slabs[VMM_SLAB] = client_pool.CudaMemory(FakeBuffer(0x10000, []), 1 << 20, 0, whole=False)
    assert not pool.needs_fds(vmm_range)


def test_a_vmm_slab_range_is_a_view_of_the_slab_mapped_once(monkeypatch):
    steps = []
    pool = _pool_with_slabs(monkeypatch, steps)

    def map_slab(export, fds):
        steps.append(("map", export.data, len(fds)))
        for fd in fds:
            os.close(fd)
        pool._slabs[export.data] = client_pool.CudaMemory(FakeBuffer(0x10000, steps), 1 << 20, 0, whole=False)

    monkeypatch.setattr(pool, "_map_slab", map_slab)
    first = Export(size=4096, offset=8192, data=VMM_SLAB, sub=True, chunks=(1 << 20,))
    r, w = os.pipe()
    os.close(w)
    mem = pool.import_allocation(first, fds=[r])
    assert steps == [("map", VMM_SLAB, 1)] and mem.ptr == 0x10000 + 8192 and not mem.whole
    # The next range of that slab maps nothing; an FD handed along anyway is closed, not kept.
    r2, w2 = os.pipe()
    os.close(w2)
    second = pool.import_allocation(Export(size=4096, offset=4096, data=VMM_SLAB, sub=True, chunks=(1 << 20,)),
                                    fds=[r2])
    assert second.ptr == 0x10000 + 4096 and len(steps) == 1
    with pytest.raises(OSError):
        os.fstat(r2)
    (batch,) = pool.import_many([Export(size=64, offset=128, data=VMM_SLAB, sub=True, chunks=(1 << 20,))])
    assert batch.ptr == 0x10000 + 128


def test_a_vmm_slab_range_without_its_slab_is_refused(monkeypatch):
    pool = _pool_with_slabs(monkeypatch, [])
    stray = Export(size=4096, offset=0, data=VMM_SLAB, sub=True, chunks=(1 << 20,))
    with pytest.raises(IpcPoolError, match="without the slab's FD"):
        pool.import_many([stray])
    with pytest.raises(IpcPoolError, match="one chunk of 1048576 bytes with its FD"):
        pool.import_allocation(stray)   # (no FD fetched for it)


def test_a_batch_imports_its_pool_slabs_on_the_worker_and_a_failed_one_raises_where_it_is_used(monkeypatch):
    steps = []
    pool = _pool_with_slabs(monkeypatch, steps)
    results = iter([0x10000, None, 0x30000])

    def import_pointer(mr, data, size):
        ptr = next(results)
        steps.append(("import", data[0]))
        if ptr is None:
            exc = IpcPoolError("cuMemPoolImportPointer failed: CUDA_ERROR_INVALID_VALUE")
            exc.cuda_result = 1
            raise exc
        return FakeBuffer(ptr, steps)

    monkeypatch.setattr(client_pool, "import_pointer", import_pointer)
    slab_a, slab_b = bytes([1] * 64), bytes([2] * 64)
    ranges = [Export(size=64, offset=off, data=slab, sub=True) for slab, off in
              ((slab_a, 0), (slab_b, 0), (slab_a, 256), (slab_b, 512))]
    got = pool.import_many(ranges)
    # Each slab once, on the worker, in the order the ranges name them; the ranges are made first.
    assert steps == ["background", ("import", 1), "background", ("import", 2)]
    assert got[0].ptr == 0x10000 and got[2].ptr == 0x10000 + 256
    with pytest.raises(IpcPoolError, match="importing a slab of pool 'p'"):
        got[1].ready()             # the failure raises where the range is first used
    assert slab_b not in pool._slabs and slab_a in pool._slabs   # forgotten: a later lease imports it again
    (again,) = pool.import_many([Export(size=64, offset=512, data=slab_b, sub=True)])
    assert again.ptr == 0x30000 + 512

