"""The ipcpool hand-off of this checkout against earlier ones, interleaved over rounds.

One run of ``handoff.py`` per checkout, one after the other, cannot tell a change from drift: on
a shared GPU host two runs of the same tree differ by as much as 40% at p50. Here each round runs
the ipcpool line of every tree once, in turn (a fresh broker and pair of processes each, from that
tree, with that tree's own ``bench/handoff.py``), so drift falls on all trees alike; the table
gives each tree's median p50 over the rounds, its spread and its ratio to the first tree.

    python bench/handoff_ab.py --tree before=/tmp/before [--tree ...] [--rounds 5] [--handoffs 500]

A tree is a checkout (``git archive REV | tar -x -C DIR``) whose ``bench/handoff.py`` has
``run_pair``, ``_ipc_producer`` and ``_ipc_consumer`` (every version since the benchmark had steps).
Writes ``bench/results/handoff_ab_<backend>_<date>.json`` and a plot beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Run in the tree's directory with the tree first on the path: its library, its benchmark.
ONE_RUN = """
import json, sys
sys.path.insert(0, ".")
from bench.common import broker
from bench import handoff as h

if __name__ == "__main__":
    n, backend = int(sys.argv[1]), sys.argv[2]
    with broker(backend, '[[pools]]\\nname = "default"\\nmax_size = "4G"\\n') as socket_dir:
        r = h.run_pair("ipcpool", h._ipc_producer, h._ipc_consumer, n + h.WARMUP, socket_dir, backend)
    print("RESULT " + json.dumps({"p50_us": r["p50_us"], "p99_us": r["p99_us"]}))
"""


def run_tree(tree: Path, handoffs: int, backend: str, timeout: float) -> dict:
    """One hand-off run of ``tree``: its p50 and p99, or the error that stopped it."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])))
    with tempfile.TemporaryDirectory(prefix="ipcpool-ab-") as tmp:
        script = Path(tmp) / "one_run.py"   # a file, not -c: spawned children re-import the main module
        script.write_text(ONE_RUN)
        try:
            proc = subprocess.run([sys.executable, str(script), str(handoffs), backend], cwd=tree, env=env,
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"no result in {timeout:g} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return {**json.loads(line[7:]), "steps": parse_steps(proc.stderr)}
    return {"error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]}


STEP_LINE = re.compile(r"(producer|consumer) step p50(?: \(mean\))?: ")
STEP = re.compile(r"([^,\n]+?) ([0-9.]+)(?: \(([0-9.]+)\))? µs")   # p50 (mean)


def parse_steps(stderr: str) -> dict[str, float]:
    """The per-step p50s the tree's pair prints on stderr ("producer step p50 (mean): create
    59.7 (61.0) µs, ..."), as {"producer create": 59.7, "producer create (mean)": 61.0, ...}
    (an older tree prints no means): where a difference between trees lies. The two processes
    print at the same moment, and a line of one may land inside the other's, so each process's
    steps are read from its marker up to the next marker or the end of its line (the lines after
    it are other reports: "... waited past the reader's spin ..., p50 465.9 µs" is no step)."""
    steps = {}
    marks = list(STEP_LINE.finditer(stderr))
    for m, nxt in zip(marks, [*marks[1:], None]):
        text = stderr[m.end(): nxt.start() if nxt else len(stderr)].split("\n", 1)[0]
        for name, us, mean in STEP.findall(text):
            steps[f"{m.group(1)} {name.strip()}"] = float(us)
            if mean:
                steps[f"{m.group(1)} {name.strip()} (mean)"] = float(mean)
    return steps


def step_medians(runs: list[dict]) -> dict[str, float]:
    """Each step's median over a tree's runs (steps a run did not print are left out)."""
    names = dict.fromkeys(k for r in runs for k in r.get("steps", {}))
    return {k: statistics.median(r["steps"][k] for r in runs if k in r.get("steps", {})) for k in names}


def summarize(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"runs": runs}
    p50s = [r["p50_us"] for r in ok]
    return {"runs": runs, "p50_median_us": statistics.median(p50s), "p50_min_us": min(p50s),
            "p50_max_us": max(p50s), "p99_median_us": statistics.median(r["p99_us"] for r in ok),
            "step_p50_medians_us": step_medians(ok)}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, tree in result["trees"].items():
        xs = [i + 1 for i, r in enumerate(tree["runs"]) if "p50_us" in r]
        ax.plot(xs, [r["p50_us"] for r in tree["runs"] if "p50_us" in r], "o-", label=name)
    ax.set_xticks(range(1, result["rounds"] + 1))
    ax.set_xlabel("round (every tree once per round, in turn)")
    ax.set_ylabel("hand-off p50, µs")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title(f"ipcpool hand-off, {result['backend']}, {result['handoffs']} per run")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def print_steps(trees: dict[str, dict]) -> None:
    """Each step's median p50 per tree, side by side."""
    names = list(dict.fromkeys(k for row in trees.values() for k in row.get("step_p50_medians_us", {})))
    if not names:
        return
    print(f"\n{'step (median of p50s, µs)':<36}" + "".join(f"{t:>12}" for t in trees))
    for k in names:
        cells = (row.get("step_p50_medians_us", {}).get(k) for row in trees.values())
        print(f"{k:<36}" + "".join(f"{v:>12.1f}" if v is not None else f"{'-':>12}" for v in cells))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="an earlier checkout to measure beside this one (repeatable; the first is the baseline)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--handoffs", type=int, default=500, help="per run (after a warm-up)")
    ap.add_argument("--backend", choices=("host", "cuda"), default="cuda")
    ap.add_argument("--timeout", type=float, default=90, help="seconds one run may take")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    trees: dict[str, Path] = {}
    for spec in args.tree:
        name, sep, path = spec.partition("=")
        if not sep or not name or not (Path(path) / "bench" / "handoff.py").is_file():
            ap.error(f"--tree takes NAME=DIR, DIR a checkout with bench/handoff.py; got {spec!r}")
        trees[name] = Path(path).resolve()
    trees["this"] = ROOT
    sys.path.insert(0, str(ROOT))
    from bench.common import gpu_device, machine, progress, save

    result: dict = {"benchmark": "handoff_ab", "backend": args.backend, "machine": machine(),
                    "handoffs": args.handoffs, "rounds": args.rounds, "trees": {}}
    if args.backend == "cuda":
        result["device"] = gpu_device()
    runs: dict[str, list[dict]] = {t: [] for t in trees}
    for rnd in range(args.rounds):
        for t, tree in trees.items():
            runs[t].append(r := run_tree(tree, args.handoffs, args.backend, args.timeout))
            said = r["error"] if "error" in r else f"p50 {r['p50_us']:.1f} µs, p99 {r['p99_us']:.1f} µs"
            progress(f"round {rnd + 1}/{args.rounds} {t}: {said}")
    for t in trees:
        result["trees"][t] = {"path": str(trees[t]), **summarize(runs[t])}
    base = result["trees"][next(iter(trees))].get("p50_median_us")
    print(f"\n{'tree':<12}{'p50 median':>11}{'min':>8}{'max':>8}{'p99 median':>12}{'vs ' + next(iter(trees)):>14}")
    for t, row in result["trees"].items():
        if "p50_median_us" not in row:
            print(f"{t:<12}{'no result':>11}")
            continue
        row["vs_first"] = row["p50_median_us"] / base if base else None
        ratio = f"{row['vs_first']:.2f}x" if base else "-"
        print(f"{t:<12}{row['p50_median_us']:>11.1f}{row['p50_min_us']:>8.1f}{row['p50_max_us']:>8.1f}"
              f"{row['p99_median_us']:>12.1f}{ratio:>14}")
    print_steps(result["trees"])
    path = save(f"handoff_ab_{args.backend}_{time.strftime('%Y%m%d-%H%M%S')}", result, plot, args.out_dir)
    print(f"-> {path}")
    return 0 if all("p50_median_us" in row for row in result["trees"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
