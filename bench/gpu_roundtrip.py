"""GPU round trip: a broker allocation (allocate + pointer import + ready-event wait) against local
``cudaMallocAsync`` (cuMemAllocFromPoolAsync on a local pool) and ``cudaMalloc`` in one process,
and broker allocations per second with 1, 4 and 16 client processes.

Starts its own broker (``python -m ipcpool broker --backend cuda``) in a temporary socket directory.
Writes ``bench/results/gpu_roundtrip_<date>.json`` and a PNG beside it.

    python bench/gpu_roundtrip.py [--iters 2000] [--seconds 3] [--size 1048576]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ipcpool  # noqa: E402
from bench.common import broker, gpu_device, machine, percentiles, progress, save  # noqa: E402


def summary(us: list[float]) -> dict:
    return percentiles([int(u * 1000) for u in us])



def broker_latency(sock: Path, size: int, iters: int) -> dict:
    from cuda.core import Device

    dev = Device(0)
    dev.set_current()
    s = dev.create_stream()
    alloc_us, free_us = [], []
    with ipcpool.connect(sock) as c:
        for i in range(iters + 50):
            t0 = time.perf_counter()
            buf = c.allocate(size, stream=s)
            t1 = time.perf_counter()
            buf.free(stream=s)
            t2 = time.perf_counter()
            if i >= 50:
                alloc_us.append((t1 - t0) * 1e6)
                free_us.append((t2 - t1) * 1e6)
            if i % 500 == 0:
                progress(f"broker round trip {i}/{iters + 50}")
        s.sync()
    return {"allocate_import_ready": summary(alloc_us), "free_oneway": summary(free_us)}


def local_latency(size: int, iters: int) -> dict:
    from cuda.bindings import driver as cu
    from cuda.core import Device, DeviceMemoryResource, DeviceMemoryResourceOptions

    dev = Device(0)
    dev.set_current()
    s = dev.create_stream()
    mr = DeviceMemoryResource(dev, DeviceMemoryResourceOptions())   # a local stream-ordered pool
    pool = cu.CUmemoryPool(int(mr.handle))
    hs = cu.CUstream(int(s.handle))
    raw_async, core_async, malloc = [], [], []
    for i in range(iters + 50):
        t0 = time.perf_counter()
        err, ptr = cu.cuMemAllocFromPoolAsync(size, pool, hs)
        t1 = time.perf_counter()
        cu.cuMemFreeAsync(ptr, hs)
        t2 = time.perf_counter()
        b = mr.allocate(size, stream=s)
        t3 = time.perf_counter()
        b.close(s)
        t4 = time.perf_counter()
        err, dptr = cu.cuMemAlloc(size)
        t5 = time.perf_counter()
        cu.cuMemFree(dptr)
        if i >= 50:
            raw_async.append((t1 - t0) * 1e6)
            core_async.append((t3 - t2) * 1e6)
            malloc.append((t5 - t4) * 1e6)
    s.sync()
    mr.close()
    progress("local allocators done")
    return {"cuMemAllocFromPoolAsync": summary(raw_async), "cuda.core pool allocate": summary(core_async),
            "cuMemAlloc (cudaMalloc)": summary(malloc)}


def _worker(sock, size, seconds, start, ready, q):
    from cuda.core import Device

    dev = Device(0)
    dev.set_current()
    s = dev.create_stream()
    n = 0
    with ipcpool.connect(sock) as c:
        c.allocate(size, stream=s).free(stream=s)   # warm: pool import, first event
        ready.put(os.getpid())
        start.wait(120)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            c.allocate(size, stream=s).free(stream=s)
            n += 1
        elapsed = time.perf_counter() - t0
        s.sync()
    q.put((n, elapsed))


def throughput(sock: Path, size: int, clients: int, seconds: float) -> dict:
    ctx = mp.get_context("spawn")
    start, ready, q = ctx.Event(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(sock), size, seconds, start, ready, q))
             for _ in range(clients)]
    for p in procs:
        p.start()
    for _ in procs:   # every worker has its CUDA context and has imported the pool
        ready.get(timeout=120)
    start.set()
    res = [q.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join(30)
    total = sum(n for n, _ in res)
    wall = max(e for _, e in res)
    progress(f"{clients} client(s): {total / wall:,.0f} allocations/s")
    return {"clients": clients, "allocations": total, "seconds": round(wall, 3),
            "allocations_per_s": round(total / wall, 1)}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    lat = {"broker allocate\n(+import+ready)": result["broker"]["allocate_import_ready"],
           "broker free\n(one-way)": result["broker"]["free_oneway"]}
    lat.update({k.replace(" (", "\n(").replace("FromPool", "\nFromPool").replace(" pool", "\npool"): v
                for k, v in result["local"].items()})
    names = list(lat)
    ax1.bar([i - 0.2 for i in range(len(names))], [lat[n]["p50_us"] for n in names], 0.4, label="p50")
    ax1.bar([i + 0.2 for i in range(len(names))], [lat[n]["p99_us"] for n in names], 0.4, label="p99")
    ax1.set_xticks(range(len(names)), names, fontsize=7)
    ax1.set_yscale("log")
    ax1.set_ylabel("µs")
    ax1.set_title(f"{result['size']} B, {result['info']['device']}")
    ax1.legend()
    tp = result["throughput"]
    ax2.plot([t["clients"] for t in tp], [t["allocations_per_s"] for t in tp], "o-")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("client processes")
    ax2.set_ylabel("allocate+free per second (all clients)")
    ax2.set_title("broker throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--size", type=int, default=1 << 20)
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)

    result: dict = {"benchmark": "gpu_roundtrip", "machine": machine(), "size": args.size,
                    "iters": args.iters, "info": gpu_device()}
    progress(f"device {result['info']}")
    with broker("cuda") as sock:
        result["broker"] = broker_latency(sock, args.size, args.iters)
        result["local"] = local_latency(args.size, args.iters)
        result["throughput"] = [throughput(sock, args.size, int(n), args.seconds)
                                for n in args.clients.split(",")]
    out = Path(args.out_dir)
    stem = f"gpu_roundtrip_{time.strftime('%Y%m%d-%H%M%S')}"
    save(stem, result, plot, out)
    print(f"\n{'what':<34}{'p50 µs':>10}{'p99 µs':>10}")
    rows = {"broker allocate+import+ready": result["broker"]["allocate_import_ready"],
            "broker free (one-way)": result["broker"]["free_oneway"], **result["local"]}
    for k, v in rows.items():
        print(f"{k:<34}{v['p50_us']:>10}{v['p99_us']:>10}")
    for t in result["throughput"]:
        print(f"{t['clients']:>3} client(s): {t['allocations_per_s']:>12,.0f} allocations/s")
    print(f"wrote {out / stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
