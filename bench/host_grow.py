"""Growing a host buffer by doubling: in-process mmap growth of a memfd against ipcpool growables.

The host counterpart of ``vmm_grow.py``. ``mmap``: one process grows its own memfd (ftruncate, then
the new tail mapped right after the current range with MAP_FIXED_NOREPLACE, the technique of
``ipcpool.backend.host.growable``): the floor a shared growable is held against. ``ipcpool``: a
growable buffer in a broker, grown by one client while a second client, attached, follows each grow
(``sync``; the time counted is the sync alone, after the notice arrived). Then ``idle sync``: the
follower's mapping set to CUDA's path (``follows = False``: it cannot see a grow by itself) and
synced ``IDLE_SYNCS`` times with nothing grown, the mean per sync (what every ``view()`` and
``__cuda_array_interface__`` access costs there). Sparse memory: nothing is written but the first
page of each step, so 1 GiB costs no RAM.

``--tree NAME=DIR`` (repeatable) measures ipcpool from another checkout too, e.g. the main branch
extracted beside this one, in the same run: each runs in a fresh process with that tree first on
its path and a broker of its own. Every method repeats the whole series ``--repeat`` times; the
table gives per-step medians. Writes ``bench/results/host_grow_<date>.json``.

    python bench/host_grow.py [--max-mib 1024] [--start-mib 2] [--repeat 7] [--tree main=/tmp/main]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
IDLE_SYNCS = 2000


def series(start: int, stop: int) -> list[int]:
    sizes, size = [], start
    while size <= stop:
        sizes.append(size)
        size *= 2
    return sizes


def touch(view_of, size: int, at: int) -> None:
    """Write one byte at ``at`` (the first page of a step): the mapping is real, not just reserved."""
    view_of()[at] = (at // MiB) % 251


def run_mmap(sizes: list[int]) -> dict:
    from ipcpool.backend.host.growable import HostClientGrowable

    fd = os.memfd_create("bench:grow", os.MFD_CLOEXEC)
    mapping = HostClientGrowable()   # its follow(): map the file's tail from the FD it holds
    steps, old = [], 0
    for size in sizes:
        t0 = time.perf_counter_ns()
        os.ftruncate(fd, size)
        if old == 0:
            mapping.extend([size], [os.dup(fd)])   # the first mapping takes (and keeps) an FD
        else:
            mapping.follow(size)
        steps.append((time.perf_counter_ns() - t0) / 1000)
        touch(mapping.view, size, old)
        old = size
    ok = all(mapping.view()[s // 2 if s > sizes[0] else 0] == ((s // 2 if s > sizes[0] else 0) // MiB) % 251
             for s in sizes)
    mapping.close()
    os.close(fd)
    return {"grow_us": steps, "data_kept": ok}


def run_ipcpool(sizes: list[int], sock: str) -> dict:
    import ipcpool

    grow_us, follow_us = [], []
    with ipcpool.connect(sock) as c, ipcpool.connect(sock) as d:
        g = h = None
        old = 0
        for size in sizes:
            t0 = time.perf_counter_ns()
            if g is None:
                g = c.create_growable("bench/host-grow", size)
            else:
                g.grow(size)
            grow_us.append((time.perf_counter_ns() - t0) / 1000)
            touch(g.view, size, old)
            if h is None:
                h = d.attach_growable("bench/host-grow")
                follow_us.append(None)
            else:
                while h._announced[1] < size:   # wait, untimed, for the broker's notice
                    d._channel.pump(1.0)
                t0 = time.perf_counter_ns()
                r = h.sync()
                follow_us.append((time.perf_counter_ns() - t0) / 1000)
                assert r.size == size, (r.size, size)
            old = size
        ok = all(h.view()[s // 2 if s > sizes[0] else 0] == ((s // 2 if s > sizes[0] else 0) // MiB) % 251
                 for s in sizes)
        h._mapping.follows = False   # CUDA's path (see the module doc)
        h.sync()
        t0 = time.perf_counter_ns()
        for _ in range(IDLE_SYNCS):
            h.sync()
        idle_us = (time.perf_counter_ns() - t0) / 1000 / IDLE_SYNCS
        h.close()
        g.close()
        c.delete_growable("bench/host-grow")
    return {"grow_us": grow_us, "follow_us": follow_us, "data_kept": ok, "idle_sync_us": idle_us}


def child(args: argparse.Namespace) -> None:
    """One method, one repeat, in this process; prints its JSON."""
    sys.path.insert(0, str(ROOT))
    if args.tree_dir:
        sys.path.insert(0, args.tree_dir)   # ahead of this checkout: that tree's ipcpool is measured
    sizes = series(args.start_mib * MiB, args.max_mib * MiB)
    if args.child == "mmap":
        out = run_mmap(sizes)
    else:
        from bench.common import broker

        with broker("host") as sock:
            out = run_ipcpool(sizes, str(sock))
    import ipcpool

    out["ipcpool_from"] = str(Path(ipcpool.__file__).parent.parent)
    print(json.dumps(out))


def run_child(method: str, tree: str | None, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", method, "--start-mib", str(args.start_mib),
           "--max-mib", str(args.max_mib)]
    env = dict(os.environ)
    if tree:
        cmd += ["--tree-dir", tree]
        env["PYTHONPATH"] = tree   # the broker runs `python -m ipcpool` from the tree too (cwd)
    got = subprocess.run(cmd, env=env, cwd=tree or ROOT, capture_output=True, text=True, timeout=120)
    if got.returncode:
        raise RuntimeError(f"{method} ({tree or 'this tree'}) failed:\n{got.stderr[-3000:]}")
    return json.loads(got.stdout.strip().splitlines()[-1])


def median_steps(runs: list[dict], key: str) -> list[float | None]:
    cols = zip(*[r[key] for r in runs])
    return [None if col[0] is None else round(statistics.median(col), 1) for col in cols]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--start-mib", type=int, default=2)
    ap.add_argument("--max-mib", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--tree", action="append", default=[], help="NAME=DIR: measure ipcpool from DIR too")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--tree-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return 0
    sizes = series(args.start_mib * MiB, args.max_mib * MiB)
    methods: dict[str, tuple[str, str | None]] = {"mmap": ("mmap", None), "ipcpool": ("ipcpool", None)}
    for spec in args.tree:
        name, _, path = spec.partition("=")
        methods[f"ipcpool@{name}"] = ("ipcpool", str(Path(path).resolve()))
    sys.path.insert(0, str(ROOT))
    from bench.common import machine

    result: dict = {"benchmark": "host_grow", "machine": machine(), "sizes": sizes, "repeat": args.repeat,
                    "methods": {}}
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    for _ in range(args.repeat):   # interleaved, so drift on the machine falls on every method alike
        for m, (kind, tree) in methods.items():
            runs[m].append(run_child(kind, tree, args))
    for m, rs in runs.items():
        row = {"grow_us": median_steps(rs, "grow_us"), "data_kept": all(r["data_kept"] for r in rs),
               "ipcpool_from": rs[0]["ipcpool_from"]}
        if "follow_us" in rs[0]:
            row["follow_us"] = median_steps(rs, "follow_us")
            row["idle_sync_us"] = round(statistics.median(r["idle_sync_us"] for r in rs), 2)
        row["total_grow_us"] = round(sum(row["grow_us"][1:]), 1)   # the grows (the first step creates)
        if "follow_us" in row:
            row["total_follow_us"] = round(sum(row["follow_us"][1:]), 1)
        result["methods"][m] = row
    floor = result["methods"]["mmap"]["total_grow_us"]
    result["ratios_over_mmap"] = {m: round(r["total_grow_us"] / floor, 2) for m, r in result["methods"].items()}

    names = list(methods)
    print(f"\nper-step medians of {args.repeat} runs, µs (grow; follow = an attached client's sync)")
    head = f"{'size':>9}" + "".join(f"{m + ' grow':>22}" for m in names)
    head += "".join(f"{m + ' follow':>24}" for m in names if m != "mmap")
    print(head)
    for i, size in enumerate(sizes):
        line = f"{size // MiB:>6} MiB" + "".join(f"{result['methods'][m]['grow_us'][i]:>22,.1f}" for m in names)
        for m in names[1:]:
            f = result["methods"][m]["follow_us"][i]
            line += f"{'-' if f is None else f'{f:,.1f}':>24}"
        print(line + ("   (create)" if i == 0 else ""))
    print("\ntotals of the grows after the create; over mmap: ipcpool's grows over in-process growth")
    print(f"{'method':<20}{'grows µs':>12}{'follows µs':>12}{'over mmap':>11}{'data kept':>11}")
    for m in names:
        r = result["methods"][m]
        follows = f"{r['total_follow_us']:,.1f}" if "total_follow_us" in r else "-"
        print(f"{m:<20}{r['total_grow_us']:>12,.1f}{follows:>12}"
              f"{result['ratios_over_mmap'][m]:>11}{str(r['data_kept']):>11}")
    print(f"\nidle sync, CUDA's path (follows = False), nothing grown: mean of {IDLE_SYNCS}, median of runs")
    for m in names[1:]:
        print(f"{m:<20}{result['methods'][m]['idle_sync_us']:>12,.2f} µs")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"host_grow_{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
