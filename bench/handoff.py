"""Hand-off latency: a producer creates, fills and seals a fresh 1 MiB object; a consumer process
gets it and reads one element. p50/p99 over N hand-offs, side by side with the peers in one run.

    python bench/handoff.py --backend host   # vs multiprocessing.shared_memory
    python bench/handoff.py --backend cuda   # vs torch.multiprocessing and cuda.core IPC buffers

Latency is from the producer's first call to the consumer holding the element (CLOCK_MONOTONIC is
one clock for every process). Writes bench/results/handoff_<backend>.json and .png.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import broker, machine, percentiles, save  # noqa: E402
from ipcpool.progress import Progress  # noqa: E402

SIZE = 1 << 20
WARMUP = 50
CTX = mp.get_context("spawn")


# Every pair speaks through four queues: go (consumer -> producer: ready for the next), link
# (producer -> consumer: t0, and the object itself where the peer passes it that way), acks
# (consumer -> producer: done, the producer may free) and out (consumer -> parent: latency, ns).

# -- ipcpool ---------------------------------------------------------------------------------------
def _ipc_producer(socket_dir, backend, n, go, link, acks):
    import ipcpool

    stream = None
    with ipcpool.connect(socket_dir) as c:
        if backend == "cuda":
            import torch

            stream = torch.cuda.Stream()
            torch.cuda.set_stream(stream)   # the worker's stream for all its work, set once
        fill = bytes(SIZE)
        steps = []
        sent = [0]
        send = c._send

        def traced(op, **fields):   # when the seal leaves (a seal waits for its create's reply after)
            rid = send(op, **fields)
            if op == "seal":
                sent[0] = time.perf_counter_ns()
            return rid

        c._send = traced
        for i in range(n):
            go.get()
            t0 = time.perf_counter_ns()
            buf = c.create(f"h/{i}", SIZE, stream=stream)
            t1 = time.perf_counter_ns()
            if backend == "cuda":
                x = buf.tensor()   # (bytes: no dtype in the metadata)
                t_view = time.perf_counter_ns()
                x.fill_(i % 251)
            else:
                x = buf.view
                t_view = time.perf_counter_ns()
                x[:] = fill
                x[0] = i % 251
            del x
            t2 = time.perf_counter_ns()
            buf.seal(stream=stream)
            t3 = time.perf_counter_ns()
            link.put((t0, sent[0] or t3))
            steps.append((t1 - t0, t_view - t1, t2 - t_view, t3 - t2))
            acks.get()
            c.delete(f"h/{i}")
        _report_steps("producer", ("create", "view", "fill", "seal"), steps)


def _ipc_consumer(socket_dir, backend, n, go, link, acks, out):
    import ipcpool

    stream = None
    with ipcpool.connect(socket_dir) as c:
        if backend == "cuda":
            import torch

            stream = torch.cuda.Stream()
            torch.cuda.set_stream(stream)
        steps = []
        for i in range(n):
            go.put(True)
            lease = c.get(f"h/{i}", stream=stream, timeout=60)
            t_got = time.perf_counter_ns()
            if backend == "cuda":
                x = lease.tensor()
                t_view = time.perf_counter_ns()
                value = int(x[0].item())
            else:
                x = lease.view
                t_view = time.perf_counter_ns()
                value = x[0]
            del x
            t1 = time.perf_counter_ns()
            assert value == i % 251, (value, i)
            lease.release(stream=stream)
            t0, t_sent = link.get()
            steps.append((t_got - t0, t_got - t_sent, t_view - t_got, t1 - t_view))
            out.put(t1 - t0)
            acks.put(True)
        _report_steps("consumer", ("start->got lease", "seal sent->got lease", "view", "read"), steps)


def _report_steps(who: str, names: tuple[str, ...], steps: list[tuple[int, ...]]) -> None:
    """p50 of each step, on stderr: where a hand-off spends its time."""
    steps = steps[WARMUP:]
    cols = []
    for k, name in enumerate(names):
        xs = sorted(s[k] for s in steps)
        cols.append(f"{name} {xs[len(xs) // 2] / 1000:.1f} µs")
    print(f"  {who} step p50: " + ", ".join(cols), file=sys.stderr, flush=True)


# -- multiprocessing.shared_memory (host peer) ------------------------------------------------------
def _shm_producer(_, __, n, go, link, acks):
    from multiprocessing import shared_memory

    fill = bytes(SIZE)
    for i in range(n):
        go.get()
        t0 = time.perf_counter_ns()
        shm = shared_memory.SharedMemory(create=True, size=SIZE)
        shm.buf[:] = fill
        shm.buf[0] = i % 251
        link.put((t0, shm.name))
        acks.get()
        shm.close()
        shm.unlink()


def _shm_consumer(_, __, n, go, link, acks, out):
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


# -- torch.multiprocessing (CUDA tensors through a Queue) -------------------------------------------
def _torch_producer(_, __, n, go, link, acks):
    import torch

    for i in range(n):
        go.get()
        t0 = time.perf_counter_ns()
        t = torch.empty(SIZE, dtype=torch.uint8, device="cuda").fill_(i % 251)
        link.put((t0, t))
        acks.get()
        del t


def _torch_consumer(_, __, n, go, link, acks, out):
    for i in range(n):
        go.put(True)
        t0, t = link.get()
        value = int(t[0].item())
        t1 = time.perf_counter_ns()
        assert value == i % 251
        del t
        out.put(t1 - t0)
        acks.put(True)


# -- cuda.core: an IPC-enabled memory resource, Buffers pickled through a Queue ----------------------
def _core_producer(_, __, n, go, link, acks):
    import torch
    from cuda.core import Device, DeviceMemoryResource, DeviceMemoryResourceOptions

    dev = Device(0)
    dev.set_current()
    stream = dev.create_stream()
    mr = DeviceMemoryResource(dev, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=1 << 30))
    link.put(mr)          # the pool travels once
    torch.cuda.set_stream(torch.cuda.ExternalStream(int(stream.handle)))
    for i in range(n):
        go.get()
        t0 = time.perf_counter_ns()
        buf = mr.allocate(SIZE, stream=stream)
        torch.from_dlpack(buf).view(torch.uint8).fill_(i % 251)
        stream.sync()     # this path has no IPC event: the producer synchronises before handing off
        link.put((t0, buf))
        acks.get()
        buf.close(stream)


def _core_consumer(_, __, n, go, link, acks, out):
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


def run_pair(label, producer, consumer, n, socket_dir=None, backend=None) -> dict:
    # SimpleQueues: no feeder thread in the timed processes to contend for their GIL.
    go, link, acks, out = CTX.SimpleQueue(), CTX.SimpleQueue(), CTX.SimpleQueue(), CTX.SimpleQueue()
    p = CTX.Process(target=producer, args=(socket_dir, backend, n, go, link, acks))
    c = CTX.Process(target=consumer, args=(socket_dir, backend, n, go, link, acks, out))
    p.start()
    c.start()
    samples = []
    try:
        with Progress(label, n, stream=sys.stdout) as bar:
            for _ in range(n):
                if not out._reader.poll(120):
                    raise TimeoutError(f"{label}: no hand-off for 120 s")
                samples.append(out.get())
                bar.update()
    finally:
        for proc in (p, c):
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    return percentiles(samples[WARMUP:])


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["peers"])
    p50 = [results["peers"][k]["p50_us"] for k in names]
    p99 = [results["peers"][k]["p99_us"] for k in names]
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([i - 0.2 for i in x], p50, 0.4, label="p50")
    ax.bar([i + 0.2 for i in x], p99, 0.4, label="p99")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("µs per 1 MiB hand-off")
    ax.set_title(f"hand-off latency ({results['backend']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("host", "cuda"), default="host")
    parser.add_argument("--handoffs", type=int, default=1000)
    parser.add_argument("--no-spin-too", action="store_true",
                        help="also run ipcpool with busy polling off, for the difference it makes")
    args = parser.parse_args()
    n = args.handoffs + WARMUP
    results = {"benchmark": "handoff", "backend": args.backend, "machine": machine(), "handoffs": args.handoffs,
               "object_bytes": SIZE, "peers": {}}
    if args.backend == "cuda":
        from bench.common import gpu_device

        results["device"] = gpu_device()
    pool = '[[pools]]\nname = "default"\nmax_size = "4G"\n'
    with broker(args.backend, pool) as socket_dir:
        results["peers"]["ipcpool"] = run_pair("ipcpool", _ipc_producer, _ipc_consumer, n, socket_dir, args.backend)
    if args.no_spin_too:   # the same without busy polling (broker busy_poll_us = 0, clients' spin 0)
        os.environ["IPCPOOL_CLIENT_SPIN_US"] = "0"   # inherited by the spawned clients
        with broker(args.backend, "busy_poll_us = 0\n" + pool) as socket_dir:
            results["peers"]["ipcpool, no busy polling"] = run_pair(
                "ipcpool, no busy polling", _ipc_producer, _ipc_consumer, n, socket_dir, args.backend)
        del os.environ["IPCPOOL_CLIENT_SPIN_US"]
    if args.backend == "host":
        results["peers"]["shared_memory"] = run_pair("multiprocessing.shared_memory", _shm_producer, _shm_consumer, n)
    else:
        results["peers"]["torch.multiprocessing"] = run_pair("torch.multiprocessing", _torch_producer, _torch_consumer, n)
        results["peers"]["cuda.core"] = run_pair("cuda.core IPC buffers", _core_producer, _core_consumer, n)
    base = results["peers"]["ipcpool"]["p50_us"]
    results["speedup_p50"] = {k: v["p50_us"] / base for k, v in results["peers"].items() if not k.startswith("ipcpool")}
    path = save(f"handoff_{args.backend}", results, plot)
    print(f"\n{'':<24}{'p50 µs':>10}{'p99 µs':>10}")
    for k, v in results["peers"].items():
        print(f"{k:<24}{v['p50_us']:>10.1f}{v['p99_us']:>10.1f}")
    for k, v in results["speedup_p50"].items():
        print(f"ipcpool p50 is {v:.2f}x faster than {k}")
    print(f"-> {path}")


if __name__ == "__main__":
    main()
