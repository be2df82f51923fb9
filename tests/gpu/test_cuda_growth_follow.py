"""CUDA growable buffers: a follower that syncs before the notice of a grow reaches it, one batch
of chunks granted access in one call, and a buffer used from a peer device."""

from __future__ import annotations

import pytest

import ipcpool
from tests.support.gpu import two_gpus

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def as_cupy(ptr: int, n: int, device: int = -1):
    import cupy

    mem = cupy.cuda.UnownedMemory(ptr, n, None, device_id=device)
    return cupy.ndarray((n,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))


def can_access_peer(a: int, b: int) -> bool:
    from cuda.bindings import driver as cu

    err, ok = cu.cuDeviceCanAccessPeer(a, b)
    return err == cu.CUresult.CUDA_SUCCESS and bool(ok)


def test_a_follower_maps_a_grow_it_has_no_notice_of(cuda_broker):
    import cupy

    with ipcpool.connect(cuda_broker.socket_dir) as c, ipcpool.connect(cuda_broker.socket_dir) as d:
        g = c.create_growable("follow/late", 2 * MiB)
        h = d.attach_growable("follow/late")
        d._channel.on_grown = lambda note: None   # as if every notice were still on its way
        for step, size in enumerate((4 * MiB, 64 * MiB, 512 * MiB, 2048 * MiB)):
            old = g.size
            g.grow(size)
            as_cupy(g.ptr + old, size - old).fill(step + 1)
            cupy.cuda.Device().synchronize()
            r = h.sync()
            assert r.grown and h.size == size
            tail = as_cupy(h.ptr + old, size - old)
            assert int(cupy.count_nonzero(tail != step + 1)) == 0
        assert h._announced[:2] == (4, 2048 * MiB)   # learnt from the broker's replies
        h.close()
        g.close()


def test_a_batch_of_chunks_is_granted_access_in_one_call(cuda_broker, monkeypatch):
    """40 grows of one granule each, then one sync: the follower maps the 40 new chunks in
    batches of FD_BATCH (one reply each) and calls cuMemSetAccess once per batch, not per chunk."""
    import cupy
    from cuda.bindings import driver as cu

    from ipcpool import protocol

    calls: list[int] = []
    real = cu.cuMemSetAccess

    def counted(ptr, size, descs, count):
        calls.append(size)
        return real(ptr, size, descs, count)

    with ipcpool.connect(cuda_broker.socket_dir) as c, ipcpool.connect(cuda_broker.socket_dir) as d:
        g = c.create_growable("follow/batch", 2 * MiB)
        h = d.attach_growable("follow/batch")
        gran = g.granularity
        for _ in range(40):
            g.grow(g.size + gran)
        as_cupy(g.ptr, g.size).fill(3)
        cupy.cuda.Device().synchronize()
        monkeypatch.setattr(cu, "cuMemSetAccess", counted)   # counts the real calls
        r = h.sync()
        monkeypatch.undo()
        assert r.grown and h.size == g.size
        assert len(calls) == -(-40 // protocol.FD_BATCH), calls
        assert int(cupy.count_nonzero(as_cupy(h.ptr, h.size) != 3)) == 0
        h.close()
        g.close()


def test_a_chunk_straddling_two_reservations_is_mapped_in_place_or_moved(cuda_broker, monkeypatch):
    """64 MiB mapped of a 128 MiB reservation, then a grow to 512 MiB: its first chunk crosses
    into the range reserved right after. Where the driver refuses that mapping the buffer moves;
    either way every byte is kept. The path taken is printed: it settles what the driver does."""
    import cupy

    monkeypatch.setenv("IPCPOOL_GROWABLE_SPAN", "0")   # reservations of twice the size

    with ipcpool.connect(cuda_broker.socket_dir) as c:
        g = c.create_growable("follow/straddle", 64 * MiB)
        assert g.reserved == 128 * MiB
        as_cupy(g.ptr, g.size).fill(5)
        cupy.cuda.Device().synchronize()
        r = g.grow(512 * MiB)
        print("a chunk across two reservations:", "moved" if r.moved else "mapped in place")
        assert r.grown and g.size == 512 * MiB
        arr = as_cupy(g.ptr, g.size)
        assert int(cupy.count_nonzero(arr[: 64 * MiB] != 5)) == 0
        arr.fill(6)
        cupy.cuda.Device().synchronize()
        g.close()


@two_gpus
def test_a_growable_is_used_from_a_peer_device(cuda_broker):
    import cupy

    if not can_access_peer(1, 0):
        pytest.skip("device 1 cannot access device 0's memory")
    with ipcpool.connect(cuda_broker.socket_dir) as c:
        g = c.create_growable("follow/peer", 2 * MiB)   # the default pool: device 0
        with cupy.cuda.Device(1):
            with ipcpool.connect(cuda_broker.socket_dir) as d:
                h = d.attach_growable("follow/peer")     # device 1 current: granted access too
                assert h._mapping.peers == (1,)
                for size in (2 * MiB, 64 * MiB, 1024 * MiB):   # growth keeps the grant
                    if size > g.size:
                        g.grow(size)
                    h.sync()
                    as_cupy(h.ptr, h.size, device=1).fill(7)   # a kernel on device 1 writes it
                    cupy.cuda.Device(1).synchronize()
                    arr = as_cupy(g.ptr, g.size, device=0)
                    with cupy.cuda.Device(0):
                        assert int(cupy.count_nonzero(arr != 7)) == 0
                h.close()
        g.close()
