"""Find the largest single pool allocation another process can import (the "4 GiB trap").

The parent creates an IPC pool per size, allocates, and starts a child per size (``pass_fds``) that
imports the pool and the pointer, fills the memory and reads its last byte back. A segfault kills
only that child. Fixed sizes first, then a bisection between the largest success and the smallest
failure at ``--resolution`` (default 1/64 GiB). Writes JSON with the device, driver and date.

    python scripts/probe_import_limit.py --out bench/results/import_limit.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # ipcpool from this checkout

GiB = 1 << 30
MiB = 1 << 20
FIXED = [
    4 * GiB - 2 * MiB, 4 * GiB - 1, 4 * GiB, 4 * GiB + 1, 4 * GiB + 2 * MiB, int(4.002 * GiB),
    int(4.0625 * GiB), int(4.25 * GiB), int(4.5 * GiB), 5 * GiB, 6 * GiB,
]


def child(fd: int, size: int, data_hex: str) -> int:
    from cuda.bindings import driver as cu
    from cuda.core import Device, DeviceMemoryResource

    from ipcpool.backend.cuda.descriptors import import_pointer

    dev = Device(0)
    dev.set_current()
    stream = dev.create_stream()
    mr = DeviceMemoryResource.from_allocation_handle(dev, fd)
    os.close(fd)
    print("pool imported", flush=True)
    buf = import_pointer(mr, bytes.fromhex(data_hex), size)
    print("pointer imported", hex(int(buf.handle)), flush=True)
    buf.fill(7, stream=stream)
    stream.sync()
    out = bytearray(1)
    import ctypes
    host = (ctypes.c_ubyte * 1).from_buffer(out)
    err, = cu.cuMemcpyDtoH(ctypes.addressof(host), cu.CUdeviceptr(int(buf.handle) + size - 1), 1)
    del host
    ok = err == cu.CUresult.CUDA_SUCCESS and out[0] == 7
    buf.close(stream)
    stream.sync()
    print("last byte", out[0], flush=True)
    return 0 if ok else 3


def try_size(size: int, timeout: float, pad: int = 0) -> dict:
    from cuda.core import Device, DeviceMemoryResource, DeviceMemoryResourceOptions

    from ipcpool.backend.cuda.descriptors import export_pointer

    dev = Device(0)
    dev.set_current()
    stream = dev.create_stream()
    mr = DeviceMemoryResource(dev, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=8 * GiB + pad))
    t0 = time.perf_counter()
    try:
        padding = mr.allocate(pad, stream=stream) if pad else None   # the allocation at an offset
        buf = mr.allocate(size, stream=stream)
        stream.sync()
        data = export_pointer(buf)
        fd = int(mr.allocation_handle)
        try:
            p = subprocess.run(
                [sys.executable, __file__, "--child", str(fd), str(size), data.hex()],
                pass_fds=(fd,), capture_output=True, text=True, timeout=timeout,
            )
            rc, tail = p.returncode, (p.stdout + p.stderr)[-400:]
        except subprocess.TimeoutExpired as exc:
            rc, tail = "timeout", str(exc)[-400:]
        buf.close(stream)
        if padding is not None:
            padding.close(stream)
        stream.sync()
    finally:
        mr.close()
    r = {"size": size, "pad": pad, "gib": round(size / GiB, 6), "rc": rc, "ok": rc == 0,
         "seconds": round(time.perf_counter() - t0, 2), "tail": tail.strip().splitlines()[-3:]}
    print(f"  {size:>12} B = {size / GiB:.6f} GiB -> {'ok' if r['ok'] else 'FAIL rc=' + str(rc)}"
          f"  ({r['seconds']} s)", flush=True)
    return r


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs=3)
    ap.add_argument("--out")
    ap.add_argument("--resolution", type=int, default=GiB // 64)
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--max-steps", type=int, default=8)
    ap.add_argument("--pad", type=int, default=0, help="allocate this much first, so sizes sit at an offset")
    ap.add_argument("--sizes", help="comma-separated sizes in GiB to try (no bisection)")
    args = ap.parse_args()
    if args.child:
        fd, size, data = args.child
        return child(int(fd), int(size), data)

    from cuda.bindings import driver as cu
    from cuda.core import Device

    dev = Device(0)
    dev.set_current()
    sizes = [int(float(x) * GiB) for x in args.sizes.split(",")] if args.sizes else FIXED
    results = [try_size(s, args.timeout, args.pad) for s in sizes]
    if args.sizes:
        args.max_steps = 0
    good = [r["size"] for r in results if r["ok"]]
    bad = [r["size"] for r in results if not r["ok"]]
    lo = max((s for s in good if not bad or s < min(bad)), default=None)
    hi = min(bad) if bad else None
    steps = 0
    if lo is not None and hi is not None:
        while hi - lo > args.resolution and steps < args.max_steps:
            mid = (lo + hi) // 2 // (2 * MiB) * (2 * MiB) or lo + 1
            if mid <= lo or mid >= hi:
                mid = (lo + hi) // 2
            r = try_size(mid, args.timeout, args.pad)
            results.append(r)
            lo, hi = (mid, hi) if r["ok"] else (lo, mid)
            steps += 1
    nonmonotonic = [s for s in good if hi is not None and s > hi]
    out = {
        "what": "largest single IPC pool allocation another process can import",
        "device": dev.name,
        "driver": cu.cuDriverGetVersion()[1],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "largest_ok": lo,
        "smallest_failure": hi,
        "resolution": args.resolution,
        "pad": args.pad,
        "nonmonotonic_successes_above_failure": nonmonotonic,
        "results": sorted(results, key=lambda r: r["size"]),
    }
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
