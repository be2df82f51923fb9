"""Hot attach on the host backend: objects resident in a broker as 1, 64, 1024 or 4096 objects; a
fresh process attaches to all of them with ``get_arrays`` and checks their values.

The host counterpart of ``hot_attach.py``: no GPU work at all, so what it measures is the client's
and the broker's own per-object cost (the request, its decoding, the leases, the arrays), which
the CUDA attach pays too. Each attach is a fresh interpreter, as a restarted worker is.

``attach``: connect done -> every object an array (``get_arrays``), split into phases by the
client's trace events (``ipcpool.trace``): each stretch between two events goes to the phase the
first one opens.

    request  the get_many round trips: packing, the broker's work and the transport (decode excluded)
    decode   msgpack decoding of the replies
    pool     importing the pool (its FD over the control socket, the mapping): once per process
    leases   the rest of get_many: exports, imports, Buffer objects
    arrays   the leases as typed numpy arrays (``typed_many``)

A tree without those events (a checkout older than ``ipcpool.trace``) gets the attach time alone.

``--tree NAME=DIR`` (repeatable) measures ipcpool from another checkout too, e.g. the main branch
extracted beside this one (``git archive main | tar -x -C /tmp/main-tree``), in the same run: each
tree has its broker, run from that tree, and every repeat runs every count of every tree in turn,
so drift on the machine falls on all alike. Writes ``bench/results/host_attach_<date>.json`` and
a plot beside it.

    python bench/host_attach.py [--mib 256] [--counts 1 64 1024 4096] [--repeat 7] [--tree main=/tmp/main-tree]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("request", "decode", "pool", "leases", "arrays")


def fill_value(i: int) -> float:
    return float((i * 7 + 3) % 251)


# -- in a child process: the tree measured is first on sys.path (PYTHONPATH) ------------------------
def _connect(sock: str, deadline: float):
    import ipcpool

    while True:
        try:
            return ipcpool.connect(sock)
        except ipcpool.BrokerGone:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def child_load(sock: str, counts: list[int], total: int) -> dict:
    import numpy as np

    with _connect(sock, time.monotonic() + 60) as c:
        for count in counts:
            n = total // count // 4
            for i in range(count):
                c.put_tensor(f"r{count}/{i:05d}", np.full(n, fill_value(i), dtype=np.float32))
    return {"loaded": counts}


# The phase each trace event opens (a reply asked for mid-batch, the next batch's, is sent while
# this one's leases are made: no event, so the stretch stays with the leases).
OPENS = {"client.wait": "request", "client.received": "decode", "client.decoded": "leases",
         "client.pool_import": "pool", "client.pool_imported": "leases", "client.views": "arrays"}


def phases_of(marks: list[tuple[int, str]], start: int, end: int) -> dict[str, float]:
    """ms per phase between ``start`` and ``end``, from (ns, event) in order; the stretch before
    the first event is the first request's packing and sending."""
    ms = dict.fromkeys(PHASES, 0.0)
    phase, since = "request", start
    for t, event in marks:
        if event in OPENS:
            ms[phase] += (t - since) / 1e6
            phase, since = OPENS[event], t
    ms[phase] += (end - since) / 1e6
    return ms


def child_attach(sock: str, count: int, t_spawn: int) -> dict:
    t_start = time.perf_counter_ns()
    import numpy as np

    import ipcpool

    tracing = None
    if (Path(ipcpool.__file__).parent / "trace.py").exists():   # (a tree older than the trace events has none)
        from ipcpool.trace import tracing
    marks: list[tuple[int, str]] = []
    names = [f"r{count}/{i:05d}" for i in range(count)]
    t_imported = time.perf_counter_ns()
    c = _connect(sock, time.monotonic() + 30)
    t_connected = time.perf_counter_ns()
    if tracing is None:
        arrays = c.get_arrays(names)
    else:
        with tracing(lambda event, _info: marks.append((time.perf_counter_ns(), event))):
            arrays = c.get_arrays(names)
    t_attached = time.perf_counter_ns()
    ok = len(arrays) == count and all(
        a.dtype == np.float32 and a[0] == fill_value(i) and a[-1] == fill_value(i)
        for i, a in enumerate(arrays[n] for n in names))
    del arrays
    c.close()
    attach = t_attached - t_connected
    phases = phases_of(marks, t_connected, t_attached) if tracing is not None else None
    return {"attach_ms": attach / 1e6, "connect_ms": (t_connected - t_imported) / 1e6,
            "import_ms": (t_imported - t_start) / 1e6, "interpreter_ms": (t_start - t_spawn) / 1e6,
            "phases_ms": phases, "ok": ok, "ipcpool_from": str(Path(ipcpool.__file__).parent.parent)}


# -- the controller ---------------------------------------------------------------------------------
def _env(tree: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)   # ahead of any installed ipcpool
    return env


def run_child(tree: Path, *args: str, timeout: float = 300) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", *args]
    got = subprocess.run(cmd, env=_env(tree), cwd=tree, capture_output=True, text=True, timeout=timeout)
    if got.returncode:
        raise RuntimeError(f"{args[0]} ({tree}) failed:\n{got.stderr[-3000:]}")
    return json.loads(got.stdout.strip().splitlines()[-1])


def start_broker(tree: Path, socket_dir: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ipcpool", "--log-level", "WARNING", "broker",
                             "--socket-dir", socket_dir, "--backend", "host"], env=_env(tree), cwd=tree)


def summarize(runs: list[dict]) -> dict:
    attach = [r["attach_ms"] for r in runs]
    row = {"attach_ms": round(statistics.median(attach), 3), "attach_max_ms": round(max(attach), 3),
           "attach_ms_all": [round(x, 3) for x in attach],
           "connect_ms": round(statistics.median(r["connect_ms"] for r in runs), 3),
           "ok": all(r["ok"] for r in runs)}
    if all(r["phases_ms"] for r in runs):
        row["phases_ms"] = {p: round(statistics.median(r["phases_ms"][p] for r in runs), 3) for p in PHASES}
    return row


def per_object_us(rows: dict[str, dict], counts: list[int], key=lambda r: r["attach_ms"]) -> float | None:
    """The slope between the smallest and the largest count, µs per object."""
    lo, hi = min(counts), max(counts)
    if lo == hi:
        return None
    return round((key(rows[str(hi)]) - key(rows[str(lo)])) * 1000 / (hi - lo), 2)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts, trees = result["counts"], list(result["trees"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for t in trees:
        rows = result["trees"][t]["rows"]
        ax1.plot(counts, [rows[str(n)]["attach_ms"] for n in counts], marker="o", label=f"{t} (median)")
        ax1.plot(counts, [rows[str(n)]["attach_max_ms"] for n in counts], ls=":", color=ax1.lines[-1].get_color(),
                 label=f"{t} (max)")
    ax1.set_xscale("log")
    ax1.set_xlabel("objects")
    ax1.set_ylabel("ms: connect done -> every object an array")
    ax1.legend()
    big = max(counts)
    left = [0.0] * len(trees)
    for p in PHASES:
        vals = [result["trees"][t]["rows"][str(big)].get("phases_ms", {}).get(p, 0) for t in trees]
        ax2.barh(trees, vals, left=left, label=p)
        left = [a + b for a, b in zip(left, vals)]
    ax2.set_xlabel(f"ms, {big} objects, by phase (medians)")
    ax2.legend()
    fig.suptitle(f"host attach, {result['mib']} MiB in all, {result['machine'].get('cpu', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB in every row (default: 256)")
    ap.add_argument("--counts", type=int, nargs="+", default=[1, 64, 1024, 4096])
    ap.add_argument("--repeat", type=int, default=7, help="fresh attaching processes per count and tree")
    ap.add_argument("--tree", action="append", default=[], help="NAME=DIR: measure ipcpool from DIR too")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--sock", help=argparse.SUPPRESS)
    ap.add_argument("--t-spawn", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    total = args.mib << 20
    if args.child == "load":
        print(json.dumps(child_load(args.sock, args.counts, total)))
        return 0
    if args.child == "attach":
        print(json.dumps(child_attach(args.sock, args.counts[0], args.t_spawn)))
        return 0

    sys.path.insert(0, str(ROOT))
    from bench.common import machine, progress, save

    trees = {"this": ROOT}
    for spec in args.tree:
        name, _, path = spec.partition("=")
        trees[name] = Path(path).resolve()
    counts = sorted(args.counts)
    result: dict = {"benchmark": "host_attach", "machine": machine(), "mib": args.mib, "counts": counts,
                    "repeat": args.repeat, "trees": {}}
    runs: dict[str, dict[int, list[dict]]] = {t: {n: [] for n in counts} for t in trees}
    brokers: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="ipcpool-attach-") as tmp:
        socks = {t: f"{tmp}/{t}" for t in trees}
        try:
            for t, tree in trees.items():
                brokers.append(start_broker(tree, socks[t]))
                run_child(tree, "load", "--sock", socks[t], "--mib", str(args.mib), "--counts", *map(str, counts))
                progress(f"{t}: {len(counts)} rows loaded")
            for rep in range(args.repeat):
                for n in counts:
                    for t, tree in trees.items():
                        runs[t][n].append(run_child(tree, "attach", "--sock", socks[t], "--counts", str(n),
                                                    "--t-spawn", str(time.perf_counter_ns())))
                progress(f"repeat {rep + 1}/{args.repeat} done")
        finally:
            for b in brokers:
                b.terminate()
                b.wait(30)
    for t in trees:
        rows = {str(n): summarize(runs[t][n]) for n in counts}
        result["trees"][t] = {"ipcpool_from": runs[t][counts[0]][0]["ipcpool_from"], "rows": rows,
                              "per_object_us": per_object_us(rows, counts)}

    print(f"\nmedians of {args.repeat} fresh processes, ms (max in brackets); {args.mib} MiB per row")
    print(f"{'tree':<10}{'objects':>8}{'attach':>18}" + "".join(f"{p:>9}" for p in PHASES) + f"{'connect':>9}  ok")
    for t in trees:
        for n in counts:
            r = result["trees"][t]["rows"][str(n)]
            ph = r.get("phases_ms")
            cols = "".join(f"{ph[p]:>9.2f}" if ph else f"{'-':>9}" for p in PHASES)
            print(f"{t:<10}{n:>8}{r['attach_ms']:>9.2f} [{r['attach_max_ms']:>6.2f}]{cols}{r['connect_ms']:>9.2f}  {r['ok']}")
        print(f"{t:<10} per object beyond the first: {result['trees'][t]['per_object_us']} µs")
    path = save(f"host_attach_{time.strftime('%Y%m%d-%H%M%S')}", result, plot, Path(args.out_dir))
    print(f"wrote {path}")
    return 0 if all(r["ok"] for t in trees for r in result["trees"][t]["rows"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
