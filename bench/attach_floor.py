"""The floor under a hot attach: a fresh process maps device memory another process exports, with
nothing of ipcpool in between (raw driver calls through cuda.bindings and cuda.core).

The exporter holds ``--gib`` GiB as ``--slab-gib`` slabs two ways: pool allocations of one
IPC-enabled memory pool (what ipcpool's slabs are) and cuMemCreate chunks (what its VMM memory
is). For each way and each thread count, a fresh child process imports everything and reports how
long the imports took, apart from its CUDA start-up:

    pool    cuMemPoolImportFromShareableHandle, then cuMemPoolImportPointer per slab
    vmm     cuMemImportFromShareableHandle + cuMemMap per chunk into one reserved range, then one
            cuMemSetAccess over the whole range

    python bench/attach_floor.py [--gib 64] [--slab-gib 1] [--threads 1,8] [--repeat 3]

``bench/hot_attach.py``'s ipcpool attach of the same memory, beside this, is how far ipcpool is
from the driver. Writes bench/results/attach_floor_<gib>gib.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GIB = 1 << 30


def _check(result):
    err, *rest = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA error {err}")
    return rest[0] if len(rest) == 1 else rest


def _vmm_prop(cu):
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def child(way: str, threads: int, slab: int, exports: list[str], fds: list[int]) -> dict:
    """Import everything; the seconds it took, apart from the context's creation."""
    from cuda.bindings import driver as cu
    from cuda.core import Device, DeviceMemoryResource

    t0 = time.perf_counter()
    Device(0).set_current()
    t1 = time.perf_counter()
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    run = (lambda f, xs: list(pool.map(f, xs))) if pool else (lambda f, xs: [f(x) for x in xs])
    if way == "pool":
        mr = DeviceMemoryResource.from_allocation_handle(0, fds[0])

        def one(hex_data: str):
            data = cu.CUmemPoolPtrExportData()
            ctypes.memmove(data.getPtr(), bytes.fromhex(hex_data), 64)
            return _check(cu.cuMemPoolImportPointer(mr.handle, data))

        run(one, exports)
    else:
        posix = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        total = slab * len(fds)
        base = int(_check(cu.cuMemAddressReserve(total, 0, 0, 0)))

        def one(k: int):
            handle = _check(cu.cuMemImportFromShareableHandle(fds[k], posix))
            _check(cu.cuMemMap(base + k * slab, slab, 0, handle, 0))
            return handle

        run(one, range(len(fds)))
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = 0
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _check(cu.cuMemSetAccess(base, total, [access], 1))
    t2 = time.perf_counter()
    return {"context_ms": (t1 - t0) * 1e3, "import_ms": (t2 - t1) * 1e3}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([f"{r['way']}, {r['threads']} thr" for r in rows], [r["import_ms"] for r in rows])
    ax.set_ylabel("ms to import (median)")
    ax.set_title(f"{result['gib']} GiB in {result['slabs']} slabs, imported by a fresh process")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        way, threads, slab, fds = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
        print(json.dumps(child(way, threads, slab, json.loads(sys.stdin.read()), fds)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=int, default=64)
    ap.add_argument("--slab-gib", type=int, default=1)
    ap.add_argument("--threads", default="1,8", help="comma-separated thread counts for the imports")
    ap.add_argument("--repeat", type=int, default=3, help="fresh processes per way and thread count")
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args()

    from cuda.bindings import driver as cu
    from cuda.core import Device, DeviceMemoryResource, DeviceMemoryResourceOptions

    from bench.common import RESULTS, gpu_device, machine, save

    dev = Device(0)
    dev.set_current()
    slab, n = args.slab_gib * GIB, args.gib // args.slab_gib
    posix = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    threads_list = [int(t) for t in args.threads.split(",")]
    rows = []

    def measure(way: str, fds: list[int], data: list[str]) -> None:
        for threads in threads_list:
            runs = []
            for _ in range(args.repeat):
                out = subprocess.run([sys.executable, __file__, "--child", way, str(threads), str(slab),
                                      json.dumps(fds)], input=json.dumps(data), pass_fds=fds,
                                     capture_output=True, text=True, timeout=300)
                if out.returncode:
                    raise SystemExit(f"{way}, {threads} threads: {out.stderr.strip()[-400:]}")
                runs.append(json.loads(out.stdout.splitlines()[-1]))
            med = statistics.median(r["import_ms"] for r in runs)
            rows.append({"way": way, "threads": threads, "import_ms": med,
                         "runs_ms": [r["import_ms"] for r in runs],
                         "context_ms": statistics.median(r["context_ms"] for r in runs)})
            print(f"{way:<5} {threads:>2} threads: {args.gib} GiB in {n} slabs imported in {med:8.2f} ms "
                  f"(median of {', '.join('%.1f' % r['import_ms'] for r in runs)}; "
                  f"{med / n:.2f} ms a slab)", flush=True)

    # One way at a time: the device holds one copy of the memory, not two.
    mr = DeviceMemoryResource(0, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=(n + 1) * slab))
    stream = dev.create_stream()
    bufs = [mr.allocate(slab, stream=stream) for _ in range(n)]
    stream.sync()
    exports = []
    for b in bufs:
        data = _check(cu.cuMemPoolExportPointer(cu.CUdeviceptr(int(b.handle))))
        exports.append(ctypes.string_at(data.getPtr(), 64).hex())
    measure("pool", [int(mr.allocation_handle)], exports)
    for b in bufs:
        b.close(stream)
    stream.sync()
    mr.close()

    chunks = [_check(cu.cuMemCreate(slab, _vmm_prop(cu), 0)) for _ in range(n)]
    fds = [int(_check(cu.cuMemExportToShareableHandle(h, posix, 0))) for h in chunks]
    measure("vmm", fds, [])
    for h, fd in zip(chunks, fds):
        os.close(fd)
        cu.cuMemRelease(h)
    result = {"benchmark": "attach_floor", "gib": args.gib, "slab_gib": args.slab_gib, "slabs": n,
              "machine": machine(), "device": gpu_device(), "rows": rows}
    path = save(f"attach_floor_{args.gib}gib", result, plot, args.out_dir or RESULTS)
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
