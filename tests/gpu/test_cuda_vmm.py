"""CUDA virtual memory across processes: growable buffers that a second process follows on both
mapping paths, compression read back, and memory above the pool import limit."""

from __future__ import annotations

import time

import pytest

import ipcpool
from tests.support.procs import SPAWN, run_together

pytestmark = pytest.mark.gpu

MiB = 1 << 20
GiB = 1 << 30


def as_cupy(ptr: int, n: int, owner=None):
    import cupy

    mem = cupy.cuda.UnownedMemory(ptr, n, owner)
    return cupy.ndarray((n,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))


def block_after(g) -> tuple[int, int]:
    """Take the address range right after ``g``'s reservation, so its next growth past the
    reservation cannot stay in place. The wall is large: the driver honours a placement hint for a
    large reservation, while it may put a small one elsewhere."""
    from cuda.bindings import driver as cu

    want, length = g.ptr + g.reserved, 16 * GiB
    err, got = cu.cuMemAddressReserve(length, 0, want, 0)
    assert err == cu.CUresult.CUDA_SUCCESS
    if int(got) != want:
        cu.cuMemAddressFree(got, length)
        pytest.fail(f"could not reserve the range after the buffer (0x{want:x}; got 0x{int(got):x})")
    return want, length


def unblock(wall) -> None:
    from cuda.bindings import driver as cu

    if wall is not None:
        cu.cuMemAddressFree(wall[0], wall[1])


def check_regions(arr, regions) -> bool:
    """Each region holds its own byte (a chunk mapped at the wrong place shows another's)."""
    import cupy

    ok = all(int(cupy.count_nonzero(arr[a:b] != seed)) == 0 for a, b, seed in regions)
    cupy.get_default_memory_pool().free_all_blocks()
    return ok


def _follower(sock, name, todo, done):
    """Attach; per message: (maybe block the range after ours,) sync, check every region written
    so far, write the newest one."""
    import cupy

    with ipcpool.connect(sock) as c:
        g = c.attach_growable(name)
        done.put(("attached", g.size))
        while (msg := todo.get(timeout=120)) != "stop":
            regions, force_move = msg
            wall = block_after(g) if force_move else None
            r = g.sync()
            arr = as_cupy(g.ptr, g.size)
            ok = check_regions(arr, regions[:-1])
            a, b, seed = regions[-1]
            arr[a:b].fill(seed)
            cupy.cuda.Device().synchronize()
            unblock(wall)
            done.put((r.grown, r.moved, g.size, ok))
        g.close()


def test_by_default_a_growable_spans_its_device_and_never_moves(cuda_broker):
    """Each process reserves address space for the device's whole memory: grown by doubling from
    2 MiB to 4 GiB the pointer never moves, here nor in a process that follows."""
    import cupy

    total = cupy.cuda.runtime.memGetInfo()[1]
    with ipcpool.connect(cuda_broker.socket_dir) as c, ipcpool.connect(cuda_broker.socket_dir) as d:
        g = c.create_growable("vmm/span", 2 * MiB)
        h = d.attach_growable("vmm/span")
        assert g.reserved >= total and h.reserved >= total
        ptr, size = g.ptr, 2 * MiB
        as_cupy(g.ptr, g.size).fill(7)
        cupy.cuda.Device().synchronize()
        while size < 4 * GiB:
            size *= 2
            r = g.grow(size)
            assert r.grown and not r.moved and g.ptr == ptr and g.size == size
        r = h.sync()
        assert r.grown and not r.moved and h.size == 4 * GiB
        assert int(cupy.count_nonzero(as_cupy(h.ptr, 2 * MiB) != 7)) == 0
        h.close()
        g.close()
        c.delete_growable("vmm/span")


def test_what_a_burst_took_from_its_loan_is_made_again_once_the_broker_is_quiet(cuda_broker):
    """Grows take chunks from the part of the broker's stock lent to the grower (broker.loans).
    What a burst of them took is made again only once no request came for a while (making a
    chunk may take a millisecond, which the burst must not wait for), then the stock is full
    again. (A grow served from the stock itself has a small chunk made again at once: the unit
    tests of refill_quick.)"""
    from ipcpool.broker.growables import QUICK_CHUNK

    def stock():
        row = c.stats()["pools"]["default"]
        return row["stock_bytes"], row["lent_bytes"]

    with ipcpool.connect(cuda_broker.socket_dir) as c:
        full, _ = stock()
        assert full >= 2 * QUICK_CHUNK + 2 * MiB   # it holds a chunk bigger than QUICK_CHUNK
        g = c.create_growable("stock/burst", 2 * MiB)
        # The rest lent (the stock holds the granularity twice), so nothing is made at once.
        assert stock() == (full - 2 * MiB, full - 2 * MiB)
        size = 2 * MiB
        while size < 2 * QUICK_CHUNK:                   # from the loan: 2, 4, ... MiB
            size *= 2
            g.grow(size)
        held, lent = stock()                            # right after: not made during the burst
        assert held == lent == full - size
        deadline = time.monotonic() + 10
        while stock()[0] < full and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stock()[0] == full
        g.close()
        c.delete_growable("stock/burst")


def test_a_follower_sees_every_grow_on_both_paths_and_data_is_kept(cuda_broker, monkeypatch):
    import cupy

    # Reservations of twice the size, as the moving path needs (the default spans the device).
    monkeypatch.setenv("IPCPOOL_GROWABLE_SPAN", "0")   # here and in the follower it spawns
    todo, done = SPAWN.Queue(), SPAWN.Queue()
    with ipcpool.connect(cuda_broker.socket_dir) as c:
        g = c.create_growable("vmm/a", 64 * MiB)
        assert g.size == 64 * MiB and g.device == 0 and g.granularity and g.reserved >= 128 * MiB
        as_cupy(g.ptr, g.size).fill(1)
        cupy.cuda.Device().synchronize()
        p = SPAWN.Process(target=_follower, args=(cuda_broker.socket_dir, "vmm/a", todo, done))
        p.start()
        try:
            assert done.get(timeout=60) == ("attached", 64 * MiB)
            regions = [(0, 64 * MiB, 1)]
            seen_paths = {"here": [], "there": []}
            # In the reservation (in place); past it (in place if the next range is free); past
            # it with that range taken in both processes (must move).
            for step, (size, force) in enumerate(((128 * MiB, False), (512 * MiB, False), (2 * GiB, True))):
                old = g.size
                wall = block_after(g) if force else None
                try:
                    r = g.grow(size)
                finally:
                    unblock(wall)
                assert r.grown and g.size == size
                if step == 0:
                    assert not r.moved                      # inside the reservation
                if force:
                    assert r.moved and r.ptr == g.ptr != r.old_ptr
                seen_paths["here"].append(r.moved)
                assert check_regions(as_cupy(g.ptr, g.size), regions)   # nothing lost, nothing copied
                regions.append((old, size, step + 2))
                todo.put((regions, force))
                grown, moved, seen, ok = done.get(timeout=120)
                assert (grown, seen, ok) == (True, size, True)
                if force:
                    assert moved                            # the follower was forced too
                seen_paths["there"].append(moved)
                assert check_regions(as_cupy(g.ptr, g.size), regions)   # the follower's writes
        finally:
            todo.put("stop")
            p.join(60)
        assert p.exitcode == 0
        print("moved per grow:", seen_paths)
        c.delete_growable("vmm/a")
        before = c.list_growables()
        g.close()
        assert before[0]["state"] == "deleting" and c.list_growables() == []


def test_compression_is_requested_and_what_was_obtained_is_reported(cuda_broker):
    import cupy
    from cuda.bindings import driver as cu

    from ipcpool.backend.cuda.vmm import compression_supported
    from tests.support.kernels import pattern

    with ipcpool.connect(cuda_broker.socket_dir) as c:
        g = c.create_growable("vmm/z", 32 * MiB, compression=True)
        assert g.compression_requested
        # What the memory really is, asked of the driver through this process's own import.
        handle = g._mapping._mapping._handles[0][0]
        prop = cu.cuMemGetAllocationPropertiesFromHandle(handle)[1]
        got = int(prop.allocFlags.compressionType) == int(cu.CUmemAllocationCompType.CU_MEM_ALLOCATION_COMP_GENERIC)
        assert g.compression == got
        if not compression_supported(0):
            assert not g.compression
        print("compression supported:", compression_supported(0), "obtained:", g.compression)
        g.grow(96 * MiB)
        arr = as_cupy(g.ptr, g.size)
        arr[:] = pattern(cupy, g.size, 9)
        assert bool((arr == pattern(cupy, g.size, 9)).all())
        plain = c.create_growable("vmm/plain", 32 * MiB)
        assert not plain.compression and not plain.compression_requested
        plain.close()
        g.close()


def _big_writer(sock, q_out, q_in):
    import cupy

    with ipcpool.connect(sock) as c:
        buf = c.allocate(8 * GiB)
        arr = as_cupy(buf.ptr, buf.size)
        arr.fill(0x5A)
        arr[-MiB:] = 0x3C
        cupy.cuda.Device().synchronize()
        q_out.put(c.share(buf))
        assert q_in.get(timeout=120) == "written"
        ok = int(arr[0]) == 0x77 and int(arr[-1]) == 0x77 and int(cupy.count_nonzero(arr[MiB:-MiB] != 0x5A)) == 0
        buf.free()
        q_out.put(("writer", ok))


def _big_reader(sock, q_in, q_out):
    import cupy

    token = q_in.get(timeout=300)
    with ipcpool.connect(sock) as c:
        buf = c.open(token)
        arr = as_cupy(buf.ptr, buf.size)
        ok = (buf.size == 8 * GiB and int(cupy.count_nonzero(arr[:-MiB] != 0x5A)) == 0
              and int(cupy.count_nonzero(arr[-MiB:] != 0x3C)) == 0)
        arr[0] = 0x77
        arr[-1] = 0x77
        cupy.cuda.Device().synchronize()
        buf.free()
        q_out.put("written")
        q_in.put(("reader", ok))


def test_8_gib_allocations_come_from_vmm_across_processes(cuda_broker):
    a, b = SPAWN.Queue(), SPAWN.Queue()
    procs = [SPAWN.Process(target=_big_writer, args=(cuda_broker.socket_dir, a, b)),
             SPAWN.Process(target=_big_reader, args=(cuda_broker.socket_dir, a, b))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    assert [p.exitcode for p in procs] == [0, 0]
    results = dict((a.get(timeout=5), a.get(timeout=5)))   # both report on ``a``
    assert results == {"writer": True, "reader": True}
    with ipcpool.connect(cuda_broker.socket_dir) as c:
        deadline = time.monotonic() + 10   # the exited clients' sessions end as their pidfds fire
        while c.stats()["pools"]["default"]["used"] >= GiB and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.stats()["pools"]["default"]["used"] < GiB    # the chunks were released


def _put_big(sock, out):
    import torch

    with ipcpool.connect(sock) as c:
        t = torch.full((8 * GiB,), 7, dtype=torch.uint8, device="cuda")
        t[-1] = 9
        c.put_tensor("big/t", t.view(2, 4 * GiB))
        out.put("put")


def _get_big(sock, out):
    import torch

    with ipcpool.connect(sock) as c:
        t = c.get_tensor("big/t", timeout=300)
        flat = t.view(-1)
        # Checked a GiB at a time: a reduction over 8 G elements may take int64 scratch (64 GiB).
        ok = (t.shape == (2, 4 * GiB) and t.dtype == torch.uint8 and int(t[1, -1]) == 9
              and all(bool(x.eq(7).all()) for x in flat[:-1].split(GiB)))
        c.release_all("big/t")
        out.put(("get", ok, t.data_ptr() != 0))


def test_an_8_gib_tensor_is_put_and_got_across_processes(cuda_broker):
    results = run_together([(_put_big, (cuda_broker.socket_dir,))], timeout=300)
    assert results == ["put"]
    (got,) = run_together([(_get_big, (cuda_broker.socket_dir,))], timeout=300)
    assert got == ("get", True, True)
    with ipcpool.connect(cuda_broker.socket_dir) as c:
        (row,) = c.list("big/")
        assert row["size"] == 8 * GiB and row["state"] == "sealed"
        c.delete("big/t")


@pytest.mark.parametrize("size", [4 * GiB + 1])
def test_just_over_the_import_limit_is_served_too(cuda_broker, size):
    import cupy

    with ipcpool.connect(cuda_broker.socket_dir) as c, c.allocate(size) as buf:
        arr = as_cupy(buf.ptr, buf.size)
        arr[-1] = 5
        assert int(arr[-1]) == 5 and buf.size == size
        cupy.cuda.Device().synchronize()
