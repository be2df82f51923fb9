"""Where a grow's time goes: each step of a buffer grown by doubling, split into the control
round trip (the request, the broker's work, the reply with the chunk FDs) and the client's mapping
(on CUDA: import the FDs, map, grant access), beside a no-op grow (the round trip alone). On CUDA
also, in one process: what making a chunk and its FD costs against importing that FD.

    python scripts/grow_phases.py [--backend cuda|host] [--max-mib 8192] [--repeat 3]

The timings wrap the client's own methods (``Channel.control_send`` and ``control_recv``, and the
mapping's ``extend``, ``follow``, and on CUDA ``map_ahead`` and ``keep``: a grow by chunks lent
ahead maps them between its request and the reply, so its round trip is what the mapping did not
hide), so they measure ipcpool's real path, one step at a time, in a fresh broker.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ipcpool  # noqa: E402
from bench.common import broker  # noqa: E402
from ipcpool._client.channel import Channel  # noqa: E402

SPENT: dict[str, int] = {}


def timed(cls, name: str, phase: str) -> None:
    """Add the time of every ``cls.name`` call to SPENT[phase]."""
    real = getattr(cls, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter_ns()
        try:
            return real(*args, **kwargs)
        finally:
            SPENT[phase] = SPENT.get(phase, 0) + time.perf_counter_ns() - t0

    setattr(cls, name, wrapper)


def mapping_class(backend: str):
    if backend == "cuda":
        from ipcpool.backend.cuda.client import CudaClientGrowable

        return CudaClientGrowable
    from ipcpool.backend.host.growable import HostClientGrowable

    return HostClientGrowable


def device_sync(backend: str):
    if backend != "cuda":
        return lambda: None
    from cuda.bindings import driver as cu

    return cu.cuCtxSynchronize


def grow_series(c, name: str, sizes: list[int], sync) -> list[tuple[float, float, float]]:
    """(step, round trip, mapping) in µs for the create at sizes[0] and each grow after."""
    rows = []
    for i, size in enumerate(sizes):
        SPENT.clear()
        t0 = time.perf_counter_ns()
        if i == 0:
            g = c.create_growable(name, size)
        else:
            g.grow(size)
        sync()
        rows.append(((time.perf_counter_ns() - t0) / 1e3, SPENT.get("round trip", 0) / 1e3, SPENT.get("mapping", 0) / 1e3))
    g.close()
    c.delete_growable(name)
    return rows


def chunk_costs() -> list[str]:
    """In one process: a chunk made and exported as an FD, against that FD imported."""
    from cuda.bindings import driver as cu

    from ipcpool.backend.cuda import vmm
    from ipcpool.backend.cuda.context import OnDevice
    from ipcpool.backend.cuda.errors import check

    out = []
    with OnDevice(0):
        for mib in (2, 64, 1024):
            made, imported = [], []
            for _ in range(5):
                t0 = time.perf_counter_ns()
                chunk = vmm.Chunk(0, mib << 20, False)
                t1 = time.perf_counter_ns()
                fd = os.dup(chunk.fd)
                t2 = time.perf_counter_ns()
                handle = check(cu.cuMemImportFromShareableHandle(fd, vmm.POSIX_FD), "cuMemImportFromShareableHandle")
                t3 = time.perf_counter_ns()
                os.close(fd)
                cu.cuMemRelease(handle)
                chunk.close()
                made.append(t1 - t0)
                imported.append(t3 - t2)
            out.append(f"{mib} MiB chunk: made and exported {statistics.median(made) / 1e3:.0f} µs, "
                       f"its FD imported {statistics.median(imported) / 1e3:.0f} µs")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("cuda", "host"), default="cuda")
    ap.add_argument("--start-mib", type=int, default=2)
    ap.add_argument("--max-mib", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=3, help="buffers grown through the series (medians kept)")
    args = ap.parse_args()
    sizes, size = [], args.start_mib << 20
    while size <= args.max_mib << 20:
        sizes.append(size)
        size *= 2
    timed(Channel, "control_send", "round trip")
    timed(Channel, "control_recv", "round trip")
    cls = mapping_class(args.backend)
    for name in ("extend", "follow", "map_ahead", "keep"):
        if hasattr(cls, name):
            timed(cls, name, "mapping")
    sync = device_sync(args.backend)
    with broker(args.backend) as sock, ipcpool.connect(sock) as c:
        runs = []
        for rep in range(args.repeat):
            runs.append(grow_series(c, f"phases/{rep}", sizes, sync))
            print(f"series {rep + 1}/{args.repeat}: {sum(r[0] for r in runs[-1]) / 1e3:.2f} ms", flush=True)
        g = c.create_growable("phases/noop", sizes[0])
        noop = []
        for _ in range(300):
            t0 = time.perf_counter_ns()
            g.grow(sizes[0])
            noop.append(time.perf_counter_ns() - t0)
        g.close()
        c.delete_growable("phases/noop")
    print(f"\n{'size':>10}{'step µs':>10}{'round trip':>12}{'mapping':>10}   (medians of {args.repeat})")
    for i, size in enumerate(sizes):
        step, rt, mapping = (statistics.median(run[i][k] for run in runs) for k in range(3))
        print(f"{size >> 20:>7} MiB{step:>10.0f}{rt:>12.0f}{mapping:>10.0f}{'   (create)' if i == 0 else ''}")
    total = statistics.median(sum(r[0] for r in run) for run in runs)
    print(f"total {total / 1e3:.2f} ms; a no-op grow (the round trip alone) p50 {statistics.median(noop) / 1e3:.1f} µs")
    if args.backend == "cuda":
        print("\n".join(chunk_costs()))


if __name__ == "__main__":
    main()
