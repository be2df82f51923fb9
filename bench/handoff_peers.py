"""The lines bench/handoff.py times ipcpool against, each a producer/consumer pair run in two
spawned processes: the floor (the same hand-off written by hand, for host and CUDA),
multiprocessing.shared_memory (host), torch.multiprocessing and cuda.core IPC buffers (CUDA).

Each pair takes the runner's queues (go, link, acks; the consumer also out, the latency in ns).
SIZE is the object every line hands off, ipcpool's pair in bench/handoff.py included.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time

SIZE = 1 << 20
WARMUP = 50   # hand-offs left out of every figure
# bench/handoff.py --writer-late-ms: each producer starts this long after its consumer is ready,
# and the consumer sleeps meanwhile (a reader that arrives before the create). Set in the runner's
# environment, which the spawned pairs inherit.
WRITER_LATE_S = float(os.environ.get("HANDOFF_WRITER_LATE_MS", "0")) / 1000
# bench/handoff.py --writer-busy-ms: each producer works this long on its CPU after its fill, before
# it hands the object off (ipcpool's reader, which found the object at its create, waits for the
# seal past its spin: a writer that prepares its data between create and seal).
WRITER_BUSY_S = float(os.environ.get("HANDOFF_WRITER_BUSY_MS", "0")) / 1000


def wait_go(go) -> None:
    """A producer's turn: its consumer is ready (then, writing late, the producer sleeps first)."""
    go.get()
    if WRITER_LATE_S:
        time.sleep(WRITER_LATE_S)


def writer_busy() -> None:
    """A producer's work between its fill and its hand-off (--writer-busy-ms), on its CPU."""
    if WRITER_BUSY_S:
        until = time.perf_counter() + WRITER_BUSY_S
        while time.perf_counter() < until:
            pass


def await_notice(pipe) -> None:
    """The floor's consumer waits for its notice: spinning, as the ipcpool client does for a while;
    writing late, asleep in the kernel until it comes (the floor of a reader woken)."""
    if WRITER_LATE_S:
        pipe.poll(None)
        return
    while not pipe.poll(0):
        pass


STEPS_ENV = "HANDOFF_STEPS_FILE"   # where a pair's processes also add their step p50s (``run_pair``)


def report_steps(who: str, names: tuple[str, ...], steps: list[tuple[int, ...]]) -> None:
    """p50 and mean of each step, on stderr: where a hand-off spends its time; and, as a JSON
    line, in the file ``STEPS_ENV`` names, where set (the results keep them)."""
    steps = steps[WARMUP:]
    p50s, means = {}, {}
    for k, name in enumerate(names):
        xs = sorted(s[k] for s in steps)
        p50s[name] = xs[len(xs) // 2] / 1000
        means[name] = sum(xs) / len(xs) / 1000 if xs else 0.0
    # one write, newline included: the producer and the consumer print at the same moment
    sys.stderr.write(f"  {who} step p50 (mean): "
                     + ", ".join(f"{k} {v:.1f} ({means[k]:.1f}) µs" for k, v in p50s.items()) + "\n")
    sys.stderr.flush()
    path = os.environ.get(STEPS_ENV)
    if path:
        with open(path, "a") as f:   # (one short line: appends of the pair's two processes stay whole)
            f.write(json.dumps({"who": who, "p50_us": p50s, "mean_us": means}) + "\n")



# -- the floor: the same hand-off done by hand, everything set up once ------------------------------
# Both processes share one memory region imported once (CUDA: an IPC pool allocation of SLOTS slots;
# host: one memfd mapping) and a duplex AF_UNIX socketpair. CUDA: SLOTS IPC events are made once by
# the producer, opened once by the consumer, and re-recorded in turn (event k again only after
# hand-off k was acknowledged); the consumer polls cuEventQuery on the host, never a stream wait.
SLOTS = 16


def floor_producer(_, backend, n, go, link, acks, pipe):
    import mmap
    from multiprocessing import reduction

    if backend == "host":
        fd = os.memfd_create("floor")
        os.ftruncate(fd, SLOTS * SIZE)
        mem = mmap.mmap(fd, SLOTS * SIZE)
        reduction.send_handle(pipe, fd, pipe.recv())   # the consumer's pid came first
        fill = bytes(SIZE)
        for i in range(n):
            wait_go(go)
            t0 = time.perf_counter_ns()
            k = i % SLOTS
            mem[k * SIZE : (k + 1) * SIZE] = fill
            mem[k * SIZE] = i % 251
            writer_busy()
            pipe.send_bytes(bytes((k,)))
            link.put((t0, t0))
            pipe.recv_bytes()   # the consumer's one-byte ack
        return
    import torch
    from cuda.bindings import driver as cu
    from cuda.core import Device, DeviceMemoryResource, DeviceMemoryResourceOptions

    dev = Device(0)
    dev.set_current()
    stream = dev.create_stream()
    mr = DeviceMemoryResource(dev, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=1 << 30))
    buf = mr.allocate(SLOTS * SIZE, stream=stream)
    stream.sync()
    flags = int(cu.CUevent_flags.CU_EVENT_INTERPROCESS) | int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
    events = [cu.cuEventCreate(flags)[1] for _ in range(SLOTS)]
    # 64 bytes read through the C struct: cuda-bindings 13.4 gives CUipcEventHandle no .reserved
    handles = []
    for e in events:
        handle = cu.cuIpcGetEventHandle(e)[1]
        handles.append(ctypes.string_at(handle.getPtr(), 64))
    link.put((mr, buf, handles))
    torch.cuda.set_stream(torch.cuda.ExternalStream(int(stream.handle)))
    whole = torch.from_dlpack(buf).view(torch.uint8)
    views = [whole[k * SIZE : (k + 1) * SIZE] for k in range(SLOTS)]
    h = int(stream.handle)
    pipe.recv_bytes()   # the consumer has opened everything
    steps = []
    for i in range(n):
        wait_go(go)
        t0 = time.perf_counter_ns()
        k = i % SLOTS
        views[k].fill_(i % 251)
        writer_busy()
        t1 = time.perf_counter_ns()
        cu.cuEventRecord(events[k], h)
        t2 = time.perf_counter_ns()
        pipe.send_bytes(k.to_bytes(8, "little") + i.to_bytes(8, "little"))   # a 16-byte notice
        t3 = time.perf_counter_ns()
        link.put((t0, t0))
        steps.append((t1 - t0, t2 - t1, t3 - t2))
        pipe.recv_bytes()
    report_steps("floor producer", ("fill", "record", "notice"), steps)
    buf.close(stream)


def floor_consumer(_, backend, n, go, link, acks, out, pipe):
    import mmap
    from multiprocessing import reduction

    if backend == "host":
        pipe.send(os.getpid())
        fd = reduction.recv_handle(pipe)
        mem = mmap.mmap(fd, SLOTS * SIZE)
        for i in range(n):
            go.put(True)
            await_notice(pipe)
            k = pipe.recv_bytes()[0]
            value = mem[k * SIZE]
            t1 = time.perf_counter_ns()
            assert value == i % 251, (value, i)
            t0, _ = link.get()
            out.put(t1 - t0)
            pipe.send_bytes(b"a")
        return
    import torch
    from cuda.bindings import driver as cu
    from cuda.core import Device

    Device(0).set_current()
    stream = Device(0).create_stream()
    torch.cuda.set_stream(torch.cuda.ExternalStream(int(stream.handle)))
    _mr, buf, handles = link.get()
    whole = torch.from_dlpack(buf).view(torch.uint8)
    views = [whole[k * SIZE : (k + 1) * SIZE] for k in range(SLOTS)]
    events = []
    for raw in handles:
        handle = cu.CUipcEventHandle()
        ctypes.memmove(handle.getPtr(), raw, 64)
        events.append(cu.cuIpcOpenEventHandle(handle)[1])
    pipe.send_bytes(b"r")
    not_ready = cu.CUresult.CUDA_ERROR_NOT_READY
    steps = []
    for i in range(n):
        go.put(True)
        await_notice(pipe)
        k = int.from_bytes(pipe.recv_bytes()[:8], "little")
        t_note = time.perf_counter_ns()
        while cu.cuEventQuery(events[k])[0] == not_ready:   # the host sees the fill complete
            pass
        t_done = time.perf_counter_ns()
        value = int(views[k][0].item())
        t1 = time.perf_counter_ns()
        assert value == i % 251, (value, i)
        t0, _ = link.get()
        steps.append((t_note - t0, t_done - t_note, t1 - t_done))
        out.put(t1 - t0)
        pipe.send_bytes(b"a")
    report_steps("floor consumer", ("start->notice", "event done", "read"), steps)
    del views, whole
    buf.close()


# -- multiprocessing.shared_memory (host peer) ------------------------------------------------------
def shm_producer(_, __, n, go, link, acks):
    from multiprocessing import shared_memory

    fill = bytes(SIZE)
    for i in range(n):
        wait_go(go)
        t0 = time.perf_counter_ns()
        shm = shared_memory.SharedMemory(create=True, size=SIZE)
        shm.buf[:] = fill
        shm.buf[0] = i % 251
        writer_busy()
        link.put((t0, shm.name))
        acks.get()
        shm.close()
        shm.unlink()


def shm_consumer(_, __, n, go, link, acks, out):
    from multiprocessing import shared_memory

    for i in range(n):
        go.put(True)
        t0, name = link.get()
        shm = shared_memory.SharedMemory(name=name)
        value = shm.buf[0]
        t1 = time.perf_counter_ns()
        assert value == i % 251
        shm.close()
        out.put(t1 - t0)
        acks.put(True)


def devices(backend: str) -> tuple[int, int]:
    """(the producer's device, the consumer's) of a CUDA run: "cuda" is (0, 0), "cuda:0,1" puts the
    consumer on GPU 1, reading GPU 0's memory (peer access)."""
    _, _, spec = backend.partition(":")
    producer, consumer = (int(d) for d in spec.split(",")) if spec else (0, 0)
    return producer, consumer


def first_reader(backend: str):
    """How a consumer reads a tensor's first element where it runs, decided once per run as the
    floor's reader has it decided (no device looked up per read): on the producer's GPU,
    ``x[0].item()``; on another, copied there first (torch orders a copy between devices after
    both devices' current streams)."""
    producer, consumer = devices(backend)
    if producer == consumer:
        return lambda x: int(x[0].item())
    there = f"cuda:{consumer}"
    return lambda x: int(x[:1].to(there).item())


# -- torch.multiprocessing (CUDA tensors through a Queue) -------------------------------------------
def torch_producer(_, backend, n, go, link, acks):
    import torch

    device = f"cuda:{devices(backend)[0]}"
    for i in range(n):
        wait_go(go)
        t0 = time.perf_counter_ns()
        t = torch.empty(SIZE, dtype=torch.uint8, device=device).fill_(i % 251)
        writer_busy()
        link.put((t0, t))
        acks.get()
        del t


def torch_consumer(_, backend, n, go, link, acks, out):
    import torch

    consumer = devices(backend)[1]
    torch.cuda.set_device(consumer)
    read_first = first_reader(backend)
    for i in range(n):
        go.put(True)
        t0, t = link.get()
        value = read_first(t)
        t1 = time.perf_counter_ns()
        assert value == i % 251
        del t
        out.put(t1 - t0)
        acks.put(True)


# -- cuda.core: an IPC-enabled memory resource, Buffers pickled through a Queue ----------------------
def core_producer(_, __, n, go, link, acks):
    import torch
    from cuda.core import Device, DeviceMemoryResource, DeviceMemoryResourceOptions

    dev = Device(0)
    dev.set_current()
    stream = dev.create_stream()
    mr = DeviceMemoryResource(dev, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=1 << 30))
    link.put(mr)          # the pool travels once
    torch.cuda.set_stream(torch.cuda.ExternalStream(int(stream.handle)))
    for i in range(n):
        wait_go(go)
        t0 = time.perf_counter_ns()
        buf = mr.allocate(SIZE, stream=stream)
        torch.from_dlpack(buf).view(torch.uint8).fill_(i % 251)
        writer_busy()
        stream.sync()     # this path has no IPC event: the producer synchronises before handing off
        link.put((t0, buf))
        acks.get()
        buf.close(stream)


def core_consumer(_, __, n, go, link, acks, out):
    import torch
    from cuda.core import Device

    Device(0).set_current()
    link.get()            # the memory resource, imported once
    for i in range(n):
        go.put(True)
        t0, buf = link.get()
        value = int(torch.from_dlpack(buf).view(torch.uint8)[0].item())
        t1 = time.perf_counter_ns()
        assert value == i % 251
        buf.close()
        out.put(t1 - t0)
        acks.put(True)
