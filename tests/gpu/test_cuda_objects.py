"""Named objects on a GPU: seal ordering, zero-copy tensors across processes, death, load."""

from __future__ import annotations

import os
import signal
import time

import pytest

import ipcpool
from tests.support.gpu import attach_all, tensor_reader, tensor_writer
from tests.support.procs import SPAWN, run_procs, run_together
from tests.support.tracing import broker_env, read

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def _slow_writer(socket_dir, seconds, size, out):
    """Seal right after launching a slow kernel that fills the object: no host sync anywhere."""
    import cupy

    from tests.support.kernels import spin_fill

    stream = cupy.cuda.Stream(non_blocking=True)
    with ipcpool.connect(socket_dir) as c:
        buf = c.create("slow/obj", size, stream=stream)
        credit = buf.carved_at is not None and bool(buf.carving.promise)   # its seal's event, promised
        t0 = time.perf_counter()
        spin_fill(buf.ptr, buf.size, seconds, 0x5A, stream)
        buf.seal(stream=stream)
        out.put(("writer", {"sealed_after_s": time.perf_counter() - t0, "carved_with_a_credit": credit}))
        stream.synchronize()


def _reader(socket_dir, out):
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with ipcpool.connect(socket_dir) as c:
        lease = c.get("slow/obj", stream=stream, timeout=60)
        with stream:
            arr = cupy.asarray(lease)
            ok = bool((arr == 0x5A).all().item())          # runs on stream, after the seal event
        lease.release(stream=stream)
        stream.synchronize()
    out.put(("reader_saw_the_writes", ok))


@pytest.mark.parametrize("size", [16 * MiB, 4 * MiB], ids=["own-allocation", "carved"])
def test_readers_wait_for_the_writers_kernel_not_the_seal_call(start_broker, size):
    """Fails if the seal event is ignored: the reader would see the pool's old bytes. Carved: the
    writer records the broker's event (a credit) and the reader waits on that very event."""
    b = start_broker(backend="cuda")
    results = dict(run_together([(_slow_writer, (b.socket_dir, 1.0, size)), (_reader, (b.socket_dir,))]))
    assert results["writer"]["sealed_after_s"] < 0.5   # seal returned while the kernel still ran
    assert results["reader_saw_the_writes"] is True
    assert results["writer"]["carved_with_a_credit"] is (size == 4 * MiB)


def test_a_carved_range_comes_back_only_after_the_writers_kernel(start_broker):
    """R2 on a credit: the broker queries its own event, recorded by the writer; the range must
    not return to the arena before the writer's kernel has finished."""
    import cupy

    from tests.support.kernels import spin_fill

    b = start_broker(backend="cuda")
    stream = cupy.cuda.Stream(non_blocking=True)
    with ipcpool.connect(b.socket_dir) as c:
        buf = c.create("slow/carved", 4 * MiB, stream=stream)
        aid, offset = buf.carved_at
        arena = c._handoff._by_arena[aid]
        assert buf.carving.promise   # the seal goes on a credit of the broker's
        spin_fill(buf.ptr, buf.size, 1.0, 0x11, stream)
        t0 = time.monotonic()
        buf.seal(stream=stream)
        c.delete("slow/carved")
        while arena.holds(offset) and time.monotonic() - t0 < 15:
            c._channel.drain()
            time.sleep(0.005)
        back_after = time.monotonic() - t0
        stream.synchronize()
    assert 0.8 < back_after < 10, back_after   # after the kernel (1 s), and not lost


def test_a_readers_release_brings_a_done_event_only_while_its_stream_has_work(start_broker, tmp_path):
    """R2 without GPU work for nothing: a directory reader's release after work the host waited
    for sends no done event (recording one would put work of the reader's on the GPU between the
    writer's next fill and the readers' copies); a release with work still running on its stream
    sends one, and the writer's range comes back only after that work."""
    import cupy

    from tests.support.kernels import spin_fill

    events = tmp_path / "events.jsonl"
    b = start_broker(backend="cuda", env=broker_env("record", events))
    stream = cupy.cuda.Stream(non_blocking=True)
    with ipcpool.connect(b.socket_dir) as w, ipcpool.connect(b.socket_dir) as r:
        at = {}
        for name in ("rel/idle", "rel/busy"):
            buf = w.create(name, MiB, stream=stream)
            at[name] = buf.carved_at
            spin_fill(buf.ptr, buf.size, 0.0, 0x5A, stream)
            buf.seal(stream=stream)
        idle = r.get("rel/idle", stream=stream, timeout=30)
        assert idle.dirlease is not None   # taken from the directory
        with stream:   # read on the stream the lease is ordered on, the host waiting for it
            assert int(cupy.asarray(idle)[0].get()) == 0x5A
        stream.synchronize()
        idle.release(stream=stream)
        busy = r.get("rel/busy", stream=stream, timeout=30)
        spin_fill(busy.ptr, 0, 1.0, 0, stream)   # a second of work on the stream, writing nothing
        t0 = time.monotonic()
        busy.release(stream=stream)
        w.delete("rel/busy")
        aid, offset = at["rel/busy"]
        arena = w._handoff._by_arena[aid]
        while arena.holds(offset) and time.monotonic() - t0 < 15:
            w._channel.drain()
            time.sleep(0.005)
        back_after = time.monotonic() - t0
        stream.synchronize()
    releases = [i["fields"] for e, i in read(events) if e == "broker.request" and i.get("op") == "release"]
    assert [("done_event" in f) for f in releases] == [False, True], releases
    assert 0.8 < back_after < 10, back_after   # after the reader's second of work (R2), and not lost


def _torch_consumer(socket_dir, i, out):
    import torch

    stream = torch.cuda.Stream()
    with ipcpool.connect(socket_dir) as c:
        t = c.get_tensor("w/embed", stream=stream, timeout=60)
        lease = next(b for b in c._leases.buffers.values() if b.name == "w/embed")
        with torch.cuda.stream(stream):
            total = float(t.double().sum().item())
        out.put((i, str(t.dtype), tuple(t.shape), total, t.data_ptr() == lease.ptr))
        c.release_all("w/embed", stream=stream)


def test_put_tensor_outlives_its_producer_and_is_zero_copy(start_broker):
    import torch

    b = start_broker(backend="cuda")
    ref = torch.arange(4096 * 16, dtype=torch.float32, device="cuda").reshape(4096, 16) / 7
    expected = float(ref.double().sum().item())
    with ipcpool.connect(b.socket_dir) as producer:
        producer.put_tensor("w/embed", ref.to(torch.bfloat16).to(torch.float32))
    # the producer is gone; the object stays
    results = run_procs(_torch_consumer, [(b.socket_dir, i) for i in range(3)])
    for _, dtype, shape, total, zero_copy in results:
        assert dtype == "torch.float32" and shape == (4096, 16) and zero_copy
        assert abs(total - expected) / expected < 1e-2
    with ipcpool.connect(b.socket_dir) as c:
        assert c.list("w/")[0]["leases"] == 0
        c.delete("w/embed")
        assert c.stats()["pools"]["default"]["used"] == 0


def test_cupy_put_and_get(start_broker):
    import cupy

    b = start_broker(backend="cuda")
    with ipcpool.connect(b.socket_dir) as c:
        a = cupy.arange(1000, dtype=cupy.int32).reshape(10, 100)
        c.put_tensor("c/a", a)
        got = c.get_array("c/a")
        assert got.dtype == cupy.int32 and got.shape == (10, 100) and bool((got == a).all())
        c.release_all("c/a")


def _dies_while_writing(socket_dir, out):
    c = ipcpool.connect(socket_dir)
    c.create("dead/sealed", 8 * MiB).seal()
    c.create("dead/unsealed", 8 * MiB)
    c.get("dead/sealed")
    out.put(os.getpid())
    time.sleep(600)


@pytest.mark.kills_clients
def test_writer_death_on_a_gpu(start_broker):
    b = start_broker(backend="cuda")
    out = SPAWN.Queue()
    p = SPAWN.Process(target=_dies_while_writing, args=(b.socket_dir, out))
    p.start()
    pid = out.get(timeout=120)
    os.kill(pid, signal.SIGKILL)
    p.join(30)
    with ipcpool.connect(b.socket_dir) as c:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            objs = [(o["name"], o["state"], o["leases"]) for o in c.list()]
            if objs == [("dead/sealed", "sealed", 0)]:
                break
            time.sleep(0.1)
        assert objs == [("dead/sealed", "sealed", 0)]
        c.delete("dead/sealed")
        deadline = time.monotonic() + 20
        while c.stats()["pools"]["default"]["used"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.stats()["pools"]["default"]["used"] == 0


def test_load_safetensors_onto_the_gpu(start_broker, tmp_path):
    import torch
    from safetensors.torch import save_file

    b = start_broker(backend="cuda")
    tensors = {"a": torch.randn(300, 70), "b": torch.arange(10, dtype=torch.int64)}
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path))
    from ipcpool.cli.load import load

    with ipcpool.connect(b.socket_dir) as c:
        assert sorted(load(c, path, prefix="m/", show_progress=False)) == ["m/a", "m/b"]
        for name, ref in tensors.items():
            got = c.get_tensor("m/" + name)
            assert got.is_cuda and got.dtype == ref.dtype and torch.equal(got.cpu(), ref)
        assert c.release_all("m/a") == 1 and c.release_all("m/b") == 1


def test_a_lease_is_seen_by_torch_and_cupy_through_both_protocols(start_broker):
    import cupy
    import torch

    b = start_broker(backend="cuda")
    with ipcpool.connect(b.socket_dir) as c:
        buf = c.create("both", 4096)
        torch.from_dlpack(buf).view(torch.uint8).fill_(7)
        buf.seal(stream=torch.cuda.current_stream())
        lease = c.get("both", stream=torch.cuda.current_stream())
        via_cai = torch.as_tensor(lease, device="cuda")            # __cuda_array_interface__
        via_dlpack = torch.from_dlpack(lease).view(torch.uint8)     # DLPack
        via_cupy = cupy.asarray(lease)
        assert via_cai.data_ptr() == via_dlpack.data_ptr() == lease.ptr == via_cupy.data.ptr
        assert int(via_cai.sum()) == int(via_dlpack.sum()) == int(via_cupy.sum()) == 7 * 4096
        assert lease.__dlpack_device__() == (2, 0)
        del via_cai, via_dlpack, via_cupy
        lease.release()


def test_get_many_across_processes_waits_for_every_seal(start_broker):
    """Objects sealed right behind slow kernels: a batch attach must still see all their bytes."""
    import cupy

    from tests.support.kernels import spin_fill

    b = start_broker(backend="cuda")
    names = [f"batch/{i}" for i in range(12)]
    sizes = [MiB] * 6 + [96 * MiB] * 6            # slab ranges and whole pool allocations
    stream = cupy.cuda.Stream(non_blocking=True)
    with ipcpool.connect(b.socket_dir) as c:
        for i, (name, size) in enumerate(zip(names, sizes)):
            buf = c.create(name, size, stream=stream)
            spin_fill(buf.ptr, size, 0.05, i + 1, stream)
            buf.seal(stream=stream)
        (sums,) = run_procs(attach_all, [(b.socket_dir, names)])
        assert sums == [(i + 1) * size for i, size in enumerate(sizes)]
        stream.synchronize()


def _tensors_all(socket_dir, names, out):
    import torch

    stream = torch.cuda.Stream()
    with ipcpool.connect(socket_dir) as c:
        tensors = c.get_tensors(names, stream=stream)
        with torch.cuda.stream(stream):
            got = {n: (tuple(t.shape), str(t.dtype), float(t.double().sum())) for n, t in tensors.items()}
    out.put(got)


def test_get_tensors_views_slab_ranges_and_whole_allocations(start_broker):
    """A batch of tensors by name: slab ranges as slices of one slab tensor, whole allocations and
    VMM-backed ones on their own; dtype and shape from the metadata, bytes from the writer."""
    import torch

    b = start_broker(backend="cuda")
    specs = {"w/a": ((64, 32), torch.float32), "w/b": ((7,), torch.int64),
             "w/c": ((4096, 8192), torch.float16), "w/d": ((3, 5), torch.bfloat16)}   # w/c: 64 MiB
    with ipcpool.connect(b.socket_dir) as c:
        want = {}
        for i, (name, (shape, dtype)) in enumerate(specs.items()):
            t = (torch.arange(int(torch.tensor(shape).prod()), device="cuda") % 97 + i).to(dtype).reshape(shape)
            c.put_tensor(name, t)
            want[name] = (shape, str(dtype), float(t.double().sum()))
        (got,) = run_procs(_tensors_all, [(b.socket_dir, list(specs))])
        assert got == want


def _attach_across_slabs(socket_dir, names, out):
    import torch

    stream = torch.cuda.Stream()
    with ipcpool.connect(socket_dir) as c:
        leases = c.get_many(names, stream=stream)
        slabs = len({id(b.memory.slab()[0]) for b in leases if b.memory.slab() is not None})
        with torch.cuda.stream(stream):
            sums = [int(torch.from_dlpack(b).view(torch.uint8).sum(dtype=torch.int64)) for b in leases]
        for b in leases:
            b.release(stream=stream)
        tensors = c.get_tensors(names, stream=stream)   # the slabs imported above: views only
        with torch.cuda.stream(stream):
            typed = [int(tensors[n].sum(dtype=torch.int64)) for n in names]
    with ipcpool.connect(socket_dir) as c:   # a fresh session: get_tensors imports the slabs itself
        tensors = c.get_tensors(names, stream=stream)
        with torch.cuda.stream(stream):
            fresh = [int(tensors[n].sum(dtype=torch.int64)) for n in names]
    out.put((slabs, sums, typed, fresh))


def test_a_batch_over_several_slabs_imports_them_behind_the_leases(start_broker):
    """A batch whose objects lie in several slabs: the slabs after the first import on the
    client's worker thread while the leases and views are made; every byte arrives, through
    get_many and through get_tensors (which waits for each slab as its views reach it)."""
    import torch

    # 64 MiB slabs, objects of up to 4 MiB in them: sixty of 3 MiB take three or more
    b = start_broker(backend="cuda", config_text='[[pools]]\nname = "default"\nmax_size = "512M"\n')
    names, size = [f"s/{i}" for i in range(60)], 3 << 20
    stream = torch.cuda.Stream()
    with ipcpool.connect(b.socket_dir) as c:
        for i, name in enumerate(names):
            buf = c.create(name, size, stream=stream, meta={"dtype": "uint8", "shape": [size]})
            with torch.cuda.stream(stream):
                torch.from_dlpack(buf).view(torch.uint8).fill_(i + 1)
            buf.seal(stream=stream)
        stream.synchronize()
        (slabs, sums, typed, fresh), = run_procs(_attach_across_slabs, [(b.socket_dir, names)])
    want = [(i + 1) * size for i in range(60)]
    assert slabs >= 3 and sums == want and typed == want and fresh == want


def test_buffer_tensor_on_both_sides_of_a_carved_handoff(start_broker):
    """Objects carved from the writer's arena (no create round trip), written and read as typed
    tensors over each slab (``Buffer.tensor``), in two processes."""
    b = start_broker(backend="cuda")
    got = dict(run_together([(tensor_writer, (b.socket_dir, 50)), (tensor_reader, (b.socket_dir, 50))]))
    assert got["carved"] == 50
    assert got["seen"] == [("torch.bfloat16", (64, 128), True, float(2 * i)) for i in range(50)]
    with ipcpool.connect(b.socket_dir) as c:
        assert len(c.list("t/")) == 50
        for i in range(50):
            c.delete(f"t/{i}")
