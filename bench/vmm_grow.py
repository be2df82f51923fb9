"""Growing a device buffer by doubling: CUDA VMM against cudaMalloc+copy, managed memory and ipcpool.

2 MiB to 8 GiB, the figure of NVIDIA's blog "Introducing Low-Level GPU Virtual Memory Management",
plus an ipcpool growable object. Each method runs alone in a fresh spawned process, so one method's
peak memory cannot shape the next. Per step: time, cumulative time and peak device memory in use
(cuMemGetInfo, above the baseline); a method that runs out of memory stops there (``oom_at``).
Starts its own broker for the ipcpool method. Writes ``bench/results/vmm_grow_<date>.json`` and a
PNG beside it.

    python bench/vmm_grow.py [--max-gib 8] [--start-mib 2] [--methods vmm,cudaMalloc+copy,...]
                             [--stocks 0,1G]

--stocks runs the ipcpool method again under brokers whose chunk stock (``[growth] stock``) is each
size given, beside the default stock: what growing costs when the chunks exist ahead and when not.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import broker, gpu_device, machine, progress, save  # noqa: E402

METHODS = ["vmm", "cudaMalloc+copy", "cudaMallocManaged", "ipcpool"]
RATIOS = {"cudaMalloc+copy": "malloc_copy_over_vmm", "cudaMallocManaged": "managed_over_vmm",
          "ipcpool": "ipcpool_over_vmm"}
PATTERN = 0x5A
GiB = 1 << 30



def human(n: int) -> str:
    return f"{n / GiB:g} GiB" if n >= GiB else f"{n / (1 << 20):g} MiB"


def doubling(start_mib: int, max_gib: float) -> list[int]:
    """The buffer sizes of a series: ``start_mib`` MiB doubled up to ``max_gib`` GiB."""
    sizes, size = [], start_mib << 20
    while size <= max_gib * GiB:
        sizes.append(size)
        size *= 2
    return sizes


class OutOfMemory(Exception):
    """The device (or the broker's pool) is full: the end of a method's series, not a failure."""


def check(ret: tuple):
    """cuda.bindings returns (CUresult, *values): raise on an error, by its name; else the values."""
    err, *vals = ret
    if err:   # CUresult is an int enum, CUDA_SUCCESS is 0
        raise (OutOfMemory if err.name == "CUDA_ERROR_OUT_OF_MEMORY" else RuntimeError)(err.name)
    return vals[0] if len(vals) == 1 else tuple(vals) or None


class Meter:
    """Peak device memory in use above the baseline. cuMemGetInfo counts the whole device, so the
    broker's allocations in its own process count too. The time spent sampling is kept apart so
    that it can be taken off the step it was sampled in."""

    def __init__(self, cu):
        self.cu, self.base, self.peak, self.spent = cu, 0, 0, 0.0
        self.base = self.used()

    def used(self) -> int:
        free, total = check(self.cu.cuMemGetInfo())
        return total - free - self.base

    def sample(self) -> None:
        t = time.perf_counter()
        self.peak = max(self.peak, self.used())
        self.spent += time.perf_counter() - t


class Vmm:
    """cuMemCreate a chunk per step; map it right after the current range where the driver grants
    that address (fast path), else remap every chunk into a fresh range (slow path). Never copies."""

    def __init__(self, cu):
        self.cu = cu
        self.prop = cu.CUmemAllocationProp()
        self.prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self.prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.prop.location.id = 0
        # the handle type ipcpool exports with, so that the costs compare with what it shares
        self.prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self.granularity = check(cu.cuMemGetAllocationGranularity(
            self.prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        access = cu.CUmemAccessDesc()
        access.location = self.prop.location
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.access = [access]
        self.chunks: list[tuple] = []              # (handle, size), in address order
        self.ranges: list[tuple[int, int]] = []    # reservations, back to back, under the chunks
        self.ptr, self.size = None, 0

    def grow(self, size: int, meter: Meter) -> str | None:
        cu, chunk = self.cu, size - self.size
        if chunk % self.granularity:
            raise ValueError(f"step of {chunk} B is not a multiple of the granularity {self.granularity} B")
        handle = check(cu.cuMemCreate(chunk, self.prop, 0))
        meter.sample()
        self.chunks.append((handle, chunk))
        if self.ptr is not None:
            end = self.ptr + self.size
            # The address is only a hint: another address, or an error, both mean "slow path".
            err, got = cu.cuMemAddressReserve(chunk, 0, end, 0)
            if not err and int(got) == end:
                check(cu.cuMemMap(end, chunk, 0, handle, 0))
                check(cu.cuMemSetAccess(end, chunk, self.access, 1))
                self.ranges.append((end, chunk))
                self.size = size
                return "fast"
            if not err:
                check(cu.cuMemAddressFree(got, chunk))
        new = base = int(check(cu.cuMemAddressReserve(size, 0, 0, 0)))
        for h, n in self.chunks:
            check(cu.cuMemMap(base, n, 0, h, 0))
            base += n
        check(cu.cuMemSetAccess(new, size, self.access, 1))
        moved = self.ptr is not None
        if moved:
            self._unmap_all(self.ptr, self.chunks[:-1])
        self.ptr, self.size, self.ranges = new, size, [(new, size)]
        return "slow" if moved else None

    def _unmap_all(self, base: int, chunks: list[tuple]) -> None:
        for _, n in chunks:
            check(self.cu.cuMemUnmap(base, n))
            base += n
        for ptr, n in self.ranges:
            check(self.cu.cuMemAddressFree(ptr, n))

    def close(self) -> None:
        self._unmap_all(self.ptr, self.chunks)
        for handle, _ in self.chunks:
            check(self.cu.cuMemRelease(handle))


class MallocCopy:
    """The realloc everyone writes: allocate the new size, copy, free the old; peaks at old + new."""

    def __init__(self, cu):
        self.cu, self.ptr, self.size = cu, None, 0

    def grow(self, size: int, meter: Meter) -> None:
        new = int(check(self.cu.cuMemAlloc(size)))
        meter.sample()
        if self.ptr is not None:
            check(self.cu.cuMemcpyDtoD(new, self.ptr, self.size))
            check(self.cu.cuMemFree(self.ptr))
        self.ptr, self.size = new, size

    def close(self) -> None:
        check(self.cu.cuMemFree(self.ptr))


class Managed(MallocCopy):
    """cudaMallocManaged + copy, then prefetch to the device (the blog's managed variant)."""

    prefetch = "not tried"   # then the call that worked, or "unavailable: <error>" for good

    def grow(self, size: int, meter: Meter) -> None:
        cu = self.cu
        new = int(check(cu.cuMemAllocManaged(size, cu.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL)))
        if self.ptr is not None:
            check(cu.cuMemcpy(new, self.ptr, self.size))
            meter.sample()   # managed pages get device memory when touched: by the copy, not the allocation
            check(cu.cuMemFree(self.ptr))
        self.ptr, self.size = new, size
        if self.prefetch.startswith("unavailable"):
            return
        # The CUmemLocation form is cuMemPrefetchAsync_v2 in 12.x bindings and the plain name in 13.x.
        fn = getattr(cu, "cuMemPrefetchAsync_v2", cu.cuMemPrefetchAsync)
        loc = cu.CUmemLocation()
        loc.type, loc.id = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE, 0
        try:
            check(fn(new, size, loc, 0, 0))
            self.prefetch = fn.__name__
        except RuntimeError as exc:   # e.g. no concurrent managed access: carry on without it
            self.prefetch = f"unavailable: {exc}"
            progress(f"cudaMallocManaged: no prefetch ({exc})")


class Ipcpool:
    """A growable object in the broker; ``moved`` in the grow result counts as a slow step."""

    def __init__(self, cu, sock: str):
        import ipcpool

        self.ipcpool, self.client, self.g = ipcpool, ipcpool.connect(sock), None
        # Made when the broker started, before the baseline: the peak column does not show it.
        self.stock_bytes = self.client.stats()["pools"]["default"].get("stock_bytes", 0)

    @property
    def ptr(self) -> int | None:
        return None if self.g is None else self.g.ptr   # where the data is now (it may have moved)

    def grow(self, size: int, meter: Meter) -> str | None:
        try:
            if self.g is None:
                self.g = self.client.create_growable("bench/grow", size)
                return None
            r = self.g.grow(size)
        except (self.ipcpool.OutOfMemory, self.ipcpool.AllocationTooLarge) as exc:
            raise OutOfMemory(f"{type(exc).__name__}: {exc}") from exc
        meter.sample()   # the broker never copies: chunks are only added and mapped
        return "slow" if r.moved else "fast"

    def close(self) -> None:
        self.g.close()
        self.client.delete_growable("bench/grow")
        self.client.close()


def measure(method: str, sizes: list[int], sock: str | None) -> dict:
    from cuda.bindings import driver as cu

    check(cu.cuInit(0))
    check(cu.cuCtxSetCurrent(check(cu.cuDevicePrimaryCtxRetain(check(cu.cuDeviceGet(0))))))
    if method == "ipcpool":
        grower = Ipcpool(cu, sock)
    else:
        grower = {"vmm": Vmm, "cudaMalloc+copy": MallocCopy, "cudaMallocManaged": Managed}[method](cu)
    meter = Meter(cu)   # after connecting: the baseline holds the context and any client state
    res: dict = {"steps": [], "data_kept": None}
    cum, pattern = 0.0, min(sizes[0], 2 << 20)
    for i, size in enumerate(sizes):
        meter.peak, meter.spent = 0, 0.0   # both per step
        t0 = time.perf_counter()
        try:
            path = grower.grow(size, meter)
            check(cu.cuCtxSynchronize())
        except OutOfMemory as exc:
            res["oom_at"] = size
            progress(f"{method}: out of memory at {human(size)} ({exc})")
            break
        us = (time.perf_counter() - t0 - meter.spent) * 1e6
        meter.sample()
        cum += us
        step = {"size": size, "step_us": round(us, 1), "cum_us": round(cum, 1), "peak_bytes": meter.peak}
        if path:
            step["path"] = path
        res["steps"].append(step)
        if i == 0 and grower.ptr is not None:   # mark the first bytes, untimed, to check at the end
            check(cu.cuMemsetD8(grower.ptr, PATTERN, pattern))
            check(cu.cuCtxSynchronize())
            res["data_kept"] = False
        progress(f"{method}: {human(size)} in {us:,.0f} µs{f' ({path})' if path else ''}")
    if res["data_kept"] is False:
        head, tail = bytearray(8), bytearray(8)
        check(cu.cuMemcpyDtoH(head, grower.ptr, 8))
        check(cu.cuMemcpyDtoH(tail, grower.ptr + pattern - 8, 8))   # ends at byte 2 MiB - 1
        res["data_kept"] = head == tail == bytes([PATTERN]) * 8
    if res["steps"]:
        try:
            grower.close()
        except Exception as exc:   # noqa: BLE001 (the process ends anyway; keep the results)
            res["cleanup_error"] = f"{type(exc).__name__}: {exc}"
    if method in ("vmm", "ipcpool"):
        for p in ("fast", "slow"):
            res[f"{p}_steps"] = sum(s.get("path") == p for s in res["steps"])
    res["total_ms"] = round(cum / 1000, 3)
    res["peak_bytes"] = max((s["peak_bytes"] for s in res["steps"]), default=0)
    for attr in ("granularity", "prefetch", "stock_bytes"):
        if hasattr(grower, attr):
            res[attr] = getattr(grower, attr)
    return res


def _child(method: str, sizes: list[int], sock: str | None, conn) -> None:
    try:
        conn.send(measure(method, sizes, sock))
    except Exception as exc:   # noqa: BLE001 (the parent records it and goes on with the next method)
        conn.send({"error": f"{type(exc).__name__}: {exc}"})


def run_method(method: str, sizes: list[int], sock: Path | None = None) -> dict:
    """One method in a fresh spawned process; a pipe, unlike a queue, says EOF if the child dies."""
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(method, sizes, sock and str(sock), send))
    p.start()
    send.close()
    try:
        res = recv.recv()
    except EOFError:
        res = None
    p.join()
    return res or {"error": f"child exited with code {p.exitcode} and no result"}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, res in result["methods"].items():
        if res.get("steps"):
            x = [s["size"] / GiB for s in res["steps"]]
            ax1.plot(x, [s["cum_us"] / 1000 for s in res["steps"]], "o-", ms=3, label=name)
            ax2.plot(x, [s["peak_bytes"] / GiB for s in res["steps"]], "o-", ms=3, label=name)
    sizes = [s / GiB for s in result["sizes"]]
    ax2.plot(sizes, sizes, "k:", lw=1, label="buffer size")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("buffer size (GiB)")
        ax.legend(fontsize=8)
    ax1.set_yscale("log")
    ax1.set_ylabel("cumulative time (ms)")
    ax1.set_title(f"grow by doubling, {result['info']['device']}")
    ax2.set_ylabel("peak device memory in use (GiB)")
    ax2.set_title("peak memory per step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def ratios(methods: dict) -> tuple[dict, dict]:
    """Cumulative time over vmm's, up to the largest size both reached (an OOM cuts a series short),
    and that size."""
    cum = {m: {s["size"]: s["cum_us"] for s in r.get("steps", [])} for m, r in methods.items()}
    out, up_to = {}, {}
    stocks = {m: f"{m.replace(' ', '_')}_over_vmm" for m in methods if m.startswith("ipcpool stock=")}
    for m, key in {**RATIOS, **stocks}.items():
        if common := set(cum.get(m, {})) & set(cum.get("vmm", {})):
            up_to[key] = top = max(common)
            out[key] = round(cum[m][top] / cum["vmm"][top], 2)
    return out, up_to


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-gib", type=float, default=8.0)
    ap.add_argument("--start-mib", type=int, default=2)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--stocks", default="", metavar="SIZE,...",
                    help="also run ipcpool under brokers with each of these chunk stocks (e.g. 0,1G)")
    args = ap.parse_args(argv)
    methods = args.methods.split(",")
    if unknown := set(methods) - set(METHODS):
        ap.error(f"unknown method(s) {sorted(unknown)}; choose from {METHODS}")
    sizes = doubling(args.start_mib, args.max_gib)
    if not sizes:
        ap.error("--max-gib is below --start-mib")

    result: dict = {"benchmark": "vmm_grow", "machine": machine(), "info": gpu_device(),
                    "sizes": sizes, "methods": {}}
    progress(f"device {result['info']}")
    for m in methods:
        progress(f"{m}: {len(sizes)} sizes, {human(sizes[0])} to {human(sizes[-1])}")
        if m == "ipcpool":
            runs = [(m, None)] + [(f"{m} stock={size}", f'[growth]\nstock = "{size}"\n')
                                  for size in filter(None, args.stocks.split(","))]
            for name, config in runs:
                try:
                    with broker("cuda", config) as sock:
                        result["methods"][name] = run_method(m, sizes, sock)
                except Exception as exc:   # noqa: BLE001 (no broker is a result for this method alone)
                    result["methods"][name] = {"error": f"broker: {type(exc).__name__}: {exc}"}
        else:
            result["methods"][m] = run_method(m, sizes)
    result["totals_ms"] = {m: r["total_ms"] for m, r in result["methods"].items() if "total_ms" in r}
    result["ratios"], result["ratios_up_to_bytes"] = ratios(result["methods"])

    out = Path(args.out_dir)
    stem = f"vmm_grow_{time.strftime('%Y%m%d-%H%M%S')}"
    save(stem, result, plot, out)
    print(f"\n{'method':<20}{'total ms':>11}{'peak GiB':>10}{'fast/slow':>11}{'data kept':>11}{'oom at GiB':>12}")
    for m, r in result["methods"].items():
        if "error" in r:
            print(f"{m:<20}  error: {r['error']}")
            continue
        fs = f"{r['fast_steps']}/{r['slow_steps']}" if "fast_steps" in r else "-"
        kept = "-" if r["data_kept"] is None else str(r["data_kept"])
        oom = f"{r['oom_at'] / GiB:g}" if "oom_at" in r else "-"
        print(f"{m:<20}{r['total_ms']:>11,.1f}{r['peak_bytes'] / GiB:>10.2f}{fs:>11}{kept:>11}{oom:>12}")
    for m, r in result["methods"].items():
        if r.get("stock_bytes"):
            print(f"{m}: the broker's stock held {r['stock_bytes'] / GiB:.2f} GiB before the baseline (not in peak)")
    print(f"ratios: {result['ratios']}")
    print(f"wrote {out / stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
