"""The hand-off on a GPU: a reader answered before the seal (pending) of a writer that dies gets
ObjectAborted; garbage on one pool's seal board harms neither the broker, nor a reader, nor the
other pool's hand-offs; pools on two devices hand out memory in turn; a steady writer's carves
made ready a few at a time."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import ipcpool
from tests.support.procs import SPAWN, run_together
from tests.support.gpu import two_gpus

pytestmark = pytest.mark.gpu

MiB = 1 << 20
TWO_POOLS = '[[pools]]\nname = "default"\nmax_size = "2G"\n\n[[pools]]\nname = "other"\nmax_size = "2G"\n'


def _writes_then_dies(socket_dir, out):
    import cupy

    from tests.support.kernels import spin_fill

    stream = cupy.cuda.Stream(non_blocking=True)
    c = ipcpool.connect(socket_dir)
    buf = c.create("gpu/gone", 4 * MiB, stream=stream)
    spin_fill(buf.ptr, buf.size, 5.0, 0x33, stream)   # killed while this runs, never sealed
    out.put(os.getpid())
    time.sleep(600)


@pytest.mark.kills_clients
def test_a_pending_reader_of_a_writer_killed_before_its_seal_gets_object_aborted(start_broker):
    b = start_broker(backend="cuda")
    out = SPAWN.Queue()
    p = SPAWN.Process(target=_writes_then_dies, args=(b.socket_dir, out))
    p.start()
    try:
        pid = out.get(timeout=120)
        with ipcpool.connect(b.socket_dir) as c:
            got = {}

            def read():
                try:
                    got["r"] = c.get("gpu/gone", timeout=60)   # answered pending at once
                except ipcpool.IpcPoolError as exc:
                    got["r"] = exc

            reader = threading.Thread(target=read)
            reader.start()
            time.sleep(1.0)   # the reader holds its pending lease: now the writer dies
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            reader.join(60)
            assert isinstance(got["r"], ipcpool.ObjectAborted), got
            assert "abandoned before it was sealed" in str(got["r"])
            assert time.monotonic() - t0 < 30
            deadline = time.monotonic() + 30
            while c.stats()["pools"]["default"]["used"] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert c.stats()["pools"]["default"]["used"] == 0   # R2: freed once the kernel is gone
    finally:
        p.join(30)


def _garbler(socket_dir, out):
    from ipcpool.shm import sealboard

    with ipcpool.connect(socket_dir) as c:
        c.allocate(4096).free()   # imports "default", and its board with it
        words = c._handoff.boards["default"]
        for i in range(sealboard.WORDS):
            words.post(i, (i * 0x9E3779B97F4A7C15) & (2**64 - 1))
        out.put(("garbled", True))


def _writer(socket_dir, names, out):
    import torch

    stream = torch.cuda.Stream()
    with ipcpool.connect(socket_dir) as c, torch.cuda.stream(stream):
        for name, pool in names:
            buf = c.create(name, MiB, pool=pool, stream=stream)
            buf.tensor().fill_(0x44)
            buf.seal(stream=stream)
        c.flush()
        stream.synchronize()
        out.put(("written", len(names)))


def _reader(socket_dir, names, out):
    import torch

    stream = torch.cuda.Stream()
    seen = []
    with ipcpool.connect(socket_dir) as c, torch.cuda.stream(stream):
        for name, _ in names:
            lease = c.get(name, stream=stream, timeout=60)
            seen.append(int(lease.tensor()[-1].item()))
            lease.release(stream=stream)
    out.put(("seen", seen))


def test_garbage_on_one_pools_board_stays_there(start_broker):
    b = start_broker(backend="cuda", config_text=TWO_POOLS)
    run_together([(_garbler, (b.socket_dir,))])
    names = [("o/1", "other"), ("o/2", "other"), ("d/1", "default")]
    got = dict(run_together([(_reader, (b.socket_dir, names)), (_writer, (b.socket_dir, names))]))
    assert got["written"] == 3
    assert got["seen"][:2] == [0x44, 0x44]   # the other pool: untouched by the garbage
    assert len(got["seen"]) == 3   # the garbled pool: its reader may read early, never crashes
    with ipcpool.connect(b.socket_dir) as c:
        assert sorted(o["name"] for o in c.list()) == ["d/1", "o/1", "o/2"]   # the broker serves on


@two_gpus
def test_pools_on_two_devices_hand_out_memory_in_turn(start_broker):
    """The broker's current device is the last one it switched to, while a session's stream on the
    other device is kept: every ready event must still be made in its stream's context (8 MiB is
    above these pools' slab ranges, so each allocation gets one)."""
    import cupy

    config = ('[[pools]]\nname = "zero"\ndevice = 0\nmax_size = "256M"\n\n'
              '[[pools]]\nname = "one"\ndevice = 1\nmax_size = "256M"\n')
    b = start_broker(backend="cuda", config_text=config)
    with ipcpool.connect(b.socket_dir) as c:
        held = []
        for k, (pool, dev) in enumerate([("zero", 0), ("one", 1), ("zero", 0), ("one", 1), ("zero", 0)]):
            with cupy.cuda.Device(dev):
                stream = cupy.cuda.Stream(non_blocking=True)
                buf = c.allocate(8 * MiB, pool=pool, stream=stream)
                assert buf.device == dev
                arr = cupy.ndarray((buf.size,), cupy.uint8, cupy.cuda.MemoryPointer(
                    cupy.cuda.UnownedMemory(buf.ptr, buf.size, buf, device_id=dev), 0))
                with stream:
                    arr[:] = k + 1
                    ok = bool((arr == k + 1).all())
                stream.synchronize()
                assert ok, (pool, k)
                del arr
                held.append((buf, stream))
        for buf, stream in held:
            buf.free(stream=stream)


def _queries_an_event_in_c(out):
    import cupy
    from cuda.bindings import driver as cu

    from ipcpool.shm import sealboard
    from tests.support.kernels import spin_fill

    cupy.cuda.Device(0).use()
    stream = cupy.cuda.Stream(non_blocking=True)
    buf = cupy.zeros(1 << 20, dtype=cupy.uint8)
    err, event = cu.cuEventCreate(int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))
    assert err == cu.CUresult.CUDA_SUCCESS
    spin_fill(buf.data.ptr, buf.size, 0.5, 7, stream)
    cu.cuEventRecord(event, stream.ptr)
    pending = (sealboard.event_query(int(event)), int(cu.cuEventQuery(event)[0]))
    stream.synchronize()
    done = (sealboard.event_query(int(event)), int(cu.cuEventQuery(event)[0]))
    cu.cuEventDestroy(event)
    out.put((pending, done, int(buf[0])))


def test_the_c_event_query_answers_as_the_drivers():
    """``sealboard.event_query`` (a reader's check that a seal's kept event completed, in C):
    pending behind a 0.5 s kernel and complete after it, as the bindings' cuEventQuery says."""
    (pending, done, first), = run_together([(_queries_an_event_in_c, ())])
    assert pending == (600, 600) and done == (0, 0) and first == 7


def _steady_writer(socket_dir, count, out):
    """Hands off ``count`` 1 MiB objects through torch views, then one of another size; says how
    many carves were made ready at once, whether each held a credit, a board word and a tensor
    view, and whether the credits of those still ready came back with the size's change."""
    import torch

    stream = torch.cuda.Stream()
    torch.cuda.set_stream(stream)
    with ipcpool.connect(socket_dir) as c:
        handoff = c._handoff
        c.create("steady/0", MiB).seal(stream=stream)
        c.flush()   # (its reply's credit in)
        made, promised, viewed = 0, True, True
        for i in range(1, count):
            buf = c.create(f"steady/{i}", MiB, stream=stream)
            buf.tensor().fill_(i % 251)
            buf.seal(stream=stream)
            if i == 1:   # the first seal of the size after another: the next ones made ready
                made = len(handoff._ahead)
                promised = all(b.carving.promise and b.carving.slot is not None for b in handoff._ahead)
                viewed = all(b.tensor_ahead is not None for b in handoff._ahead)
        stream.synchronize()
        c.flush()
        held = [b.carving.promise for b in handoff._ahead]
        other = c.create("steady/other", MiB // 2, stream=stream)   # another size: all go back, and
        back = [other.carving.promise, *handoff._credits["default"]]   # the first serves this create
        other.free(stream=stream)
        c.flush()
        out.put(("writer", {"made": made, "promised": promised, "viewed": viewed, "held": len(held),
                            "back": back[:len(held)] == held, "async": c.async_errors}))


def _steady_reader(socket_dir, count, out):
    import torch

    stream = torch.cuda.Stream()
    torch.cuda.set_stream(stream)
    seen = []
    with ipcpool.connect(socket_dir) as c:
        for i in range(1, count):
            with c.get(f"steady/{i}", stream=stream, timeout=60) as lease:
                seen.append(int(lease.tensor()[0].item()))
    out.put(("seen", seen))


def test_a_steady_writers_carves_made_ready_at_once_hold_credits_and_views_and_give_them_back(start_broker):
    """A writer of one size on a GPU gets its next few carves made ready at one seal, each with the
    credit its seal is recorded on, a board word and its tensor view; a reader in another process
    reads every object's own bytes; a create of another size gives every credit back."""
    b = start_broker(backend="cuda")
    got = dict(run_together([(_steady_writer, (b.socket_dir, 30)), (_steady_reader, (b.socket_dir, 30))]))
    assert got["seen"] == [i % 251 for i in range(1, 30)]
    writer = got["writer"]
    assert writer["made"] == 4 and writer["promised"] and writer["viewed"]
    assert writer["held"] > 0 and writer["back"]   # the credits of those still ready came back, in order
    assert writer["async"] == []


def _lockstep_writer(socket_dir, count, sealed, read, out):
    """Hands off ``count`` 1 MiB objects one at a time: each filled, sealed and done on the GPU
    before its reader is told (``sealed``), deleted once read (``read``)."""
    import torch

    stream = torch.cuda.Stream()
    torch.cuda.set_stream(stream)
    with ipcpool.connect(socket_dir) as c:
        for i in range(count):
            buf = c.create(f"step/{i}", MiB, stream=stream)
            buf.tensor().fill_(i % 251)
            buf.seal(stream=stream)
            stream.synchronize()
            sealed.put(i)
            read.get(timeout=60)
            c.delete(f"step/{i}")
        out.put(("writer", c.async_errors))


def _lockstep_reader(socket_dir, count, sealed, read, out):
    import torch

    stream = torch.cuda.Stream()
    torch.cuda.set_stream(stream)
    seen, made = [], [0]
    with ipcpool.connect(socket_dir) as c:
        ahead = c._handoff._next
        taken = ahead.hit

        def counted(*args):   # (the one-call take of the lease made ahead)
            made[0] += 1
            return taken(*args)

        ahead.hit = counted
        for _ in range(count):
            i = sealed.get(timeout=60)
            with c.get(f"step/{i}", stream=stream, timeout=60) as lease:
                seen.append(int(lease.tensor()[0].item()))
            read.put(i)
    out.put(("reader", (seen, made[0])))


def test_a_reader_of_sealed_objects_takes_the_lease_made_ahead_in_one_call(start_broker):
    """A reader that asks once each object is sealed and its seal done on the GPU gets most of
    them with the lease made ahead, in one C call that finds the seal's credit open in its table
    and the driver saying it is done (``backend.cuda.credits``); each object's own bytes read."""
    b = start_broker(backend="cuda")
    sealed, read, n = SPAWN.Queue(), SPAWN.Queue(), 64
    got = dict(run_together([(_lockstep_writer, (b.socket_dir, n, sealed, read)),
                             (_lockstep_reader, (b.socket_dir, n, sealed, read))]))
    seen, made = got["reader"]
    assert seen == [i % 251 for i in range(n)]
    assert made >= n // 2, f"{made} of {n} taken as made ahead"   # (made once each range was read twice)
    assert got["writer"] == []
