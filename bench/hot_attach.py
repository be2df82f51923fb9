"""Hot attach: weights resident in the broker as 1, 64 or 1024 objects; a fresh process attaches
to all of them and verifies a checksum. Against loading the same bytes from pinned host memory and
from a safetensors file, each in a fresh process too.

    python bench/hot_attach.py [--gib 8] [--counts 64 1024] [--repeat 3] [--ipcpool-only] [--out-dir DIR]
                                                     (GPU; the host backend: bench/host_attach.py)

attach: connect done -> every object mapped as a torch tensor (the median of --repeat fresh
processes; each one's time is kept too). ready: the process's start -> data verified on the GPU
(includes the interpreter, torch and the CUDA context, as a restarted worker pays). Writes
bench/results/hot_attach.json and .png (--out-dir: elsewhere; with --ipcpool-only, which leaves
out the pinned and safetensors loads, hot_attach_<gib>gib.json).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import broker, gpu_device, machine, save  # noqa: E402

CTX = mp.get_context("spawn")


def _fill_value(i: int) -> int:
    return (i * 7 + 3) % 251


def _sum(t):
    """The sum of a flat uint8 tensor as an int64 tensor, in 256 MiB slices: torch casts what it
    sums to the result's dtype first, 8 bytes an element, which a 64 GiB tensor has no room for."""
    import torch

    step = 256 << 20
    flat = t.view(-1)
    return sum((flat[i:i + step].sum(dtype=torch.int64) for i in range(0, flat.numel(), step)),
               torch.zeros((), dtype=torch.int64, device=t.device))


def expected_checksum(count: int, size: int) -> int:
    return sum(_fill_value(i) for i in range(count)) * size


def _load(socket_dir, prefix, count, size, out):
    import torch

    import ipcpool

    with ipcpool.connect(socket_dir) as c:
        stream = torch.cuda.Stream()
        for i in range(count):
            buf = c.create(f"{prefix}{i:05d}", size, stream=stream, meta={"dtype": "uint8", "shape": [size]})
            with torch.cuda.stream(stream):
                torch.from_dlpack(buf).view(torch.uint8).fill_(_fill_value(i))
            buf.seal(stream=stream)
        stream.synchronize()
    out.put("loaded")


def _attach(socket_dir, prefix, count, t_spawn, out):
    t_start = time.perf_counter_ns()
    import torch

    import ipcpool

    torch.cuda.init()
    t_ctx = time.perf_counter_ns()
    with ipcpool.connect(socket_dir) as c:
        t_connected = time.perf_counter_ns()
        tensors = c.get_tensors([f"{prefix}{i:05d}" for i in range(count)])
        t_attached = time.perf_counter_ns()
        total = torch.zeros((), dtype=torch.int64, device="cuda")
        for t in tensors.values():
            total += _sum(t)
        checksum = int(total.item())
        t_ready = time.perf_counter_ns()
        del tensors   # the leases go with the client
    out.put({"attach_ms": (t_attached - t_connected) / 1e6, "ready_ms": (t_ready - t_spawn) / 1e6,
             "interpreter_ms": (t_start - t_spawn) / 1e6, "torch_and_context_ms": (t_ctx - t_start) / 1e6,
             "checksum": checksum})


def _pinned(total_bytes, t_spawn, out):
    import torch

    host = torch.empty(total_bytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(5)                                   # set-up: the bytes are "already in RAM"
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    dev = torch.empty(total_bytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    checksum = int(_sum(dev).item())
    t1 = time.perf_counter_ns()
    out.put({"attach_ms": (t1 - t0) / 1e6, "ready_ms": (t1 - t_spawn) / 1e6, "checksum": checksum})


def _safetensors(path, t_spawn, out):
    import torch
    from safetensors.torch import load_file

    torch.cuda.init()
    t0 = time.perf_counter_ns()
    tensors = load_file(path, device="cuda")
    checksum = int(sum(_sum(t) for t in tensors.values()).item())
    t1 = time.perf_counter_ns()
    out.put({"attach_ms": (t1 - t0) / 1e6, "ready_ms": (t1 - t_spawn) / 1e6, "checksum": checksum})


def fresh(target, *args) -> dict:
    out = CTX.Queue()
    t_spawn = time.perf_counter_ns()
    p = CTX.Process(target=target, args=(*args, t_spawn, out))
    p.start()
    res = out.get(timeout=600)
    p.join(120)
    return res


def _write_safetensors(path, count, size) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({f"t{i:05d}": torch.full((size,), _fill_value(i), dtype=torch.uint8) for i in range(count)}, path)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    labels = [r["method"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.barh(labels, [r["attach_ms"] for r in rows])
    ax1.set_xscale("log")
    ax1.set_xlabel("ms: attach / load")
    ax2.barh(labels, [r["ready_ms"] for r in rows])
    ax2.set_xlabel("ms: process start -> data verified on the GPU")
    fig.suptitle(f"{results['gib']} GiB of weights, {results['device']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=int, default=8)
    ap.add_argument("--counts", type=int, nargs="+", default=[64, 1024])
    ap.add_argument("--repeat", type=int, default=3, help="fresh attaching processes per layout (median kept)")
    ap.add_argument("--ipcpool-only", action="store_true",
                    help="only the ipcpool rows: no pinned-host copy, no safetensors file (large --gib)")
    ap.add_argument("--slab-memory", choices=("pool", "vmm"), default="pool",
                    help="what the pool's slabs are (the pool's slab_memory): pool allocations or VMM chunks")
    ap.add_argument("--out-dir", type=Path, default=None, help="where the JSON and PNG go (default bench/results)")
    args = ap.parse_args()
    total = args.gib << 30
    results = {"benchmark": "hot_attach", "machine": machine(), "device": gpu_device(), "gib": args.gib,
               "slab_memory": args.slab_memory, "rows": []}
    with broker("cuda", f'[[pools]]\nname = "default"\nslab_memory = "{args.slab_memory}"\n') as sock:
        for count in [1, *args.counts]:
            size = total // count   # above the pool import limit, objects are VMM chunks
            prefix = f"w{count}/"
            q = CTX.Queue()
            p = CTX.Process(target=_load, args=(str(sock), prefix, count, size, q))
            p.start()
            q.get(timeout=600)
            p.join(60)
            runs = [fresh(_attach, str(sock), prefix, count) for _ in range(args.repeat)]
            r = sorted(runs, key=lambda x: x["attach_ms"])[len(runs) // 2]   # the median attach
            r.update(method=f"ipcpool, {count} objects", attach_ms_all=[x["attach_ms"] for x in runs],
                     ok=all(x["checksum"] == expected_checksum(count, size) for x in runs))
            results["rows"].append(r)
            print(f"ipcpool {count:>5} objects: attach {r['attach_ms']:8.2f} ms (median of "
                  f"{', '.join(f'{x:.1f}' for x in r['attach_ms_all'])}), ready {r['ready_ms']:8.1f} ms, "
                  f"checksum {'ok' if r['ok'] else 'WRONG'}", flush=True)
            import ipcpool

            with ipcpool.connect(sock) as c:
                for o in c.list(prefix):
                    c.delete(o["name"])
    name = (f"hot_attach_{args.gib}gib" if args.ipcpool_only else "hot_attach") + \
        ("_vmm_slabs" if args.slab_memory == "vmm" else "")
    if args.ipcpool_only:
        finish(name, results, args.out_dir)
        return
    r = fresh(_pinned, total)
    r.update(method="pinned host -> GPU", ok=r["checksum"] == 5 * total)
    results["rows"].append(r)
    print(f"pinned host copy: {r['attach_ms']:8.2f} ms, ready {r['ready_ms']:8.1f} ms", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/w.safetensors"
        count = 64
        _write_safetensors(path, count, total // count)
        r = fresh(_safetensors, path)
        r.update(method="safetensors file -> GPU", ok=r["checksum"] == expected_checksum(count, total // count))
        results["rows"].append(r)
        print(f"safetensors load: {r['attach_ms']:8.2f} ms, ready {r['ready_ms']:8.1f} ms", flush=True)
    finish(name, results, args.out_dir)


def finish(name: str, results: dict, out_dir: Path | None) -> None:
    save(name, results, plot, *([out_dir] if out_dir else []))
    print(f"\n{'method':<28}{'attach ms':>12}{'max ms':>10}{'ready ms':>12}  ok")
    for r in results["rows"]:
        most = max(r.get("attach_ms_all", [r["attach_ms"]]))
        print(f"{r['method']:<28}{r['attach_ms']:>12.2f}{most:>10.2f}{r['ready_ms']:>12.1f}  {r['ok']}")


if __name__ == "__main__":
    main()
