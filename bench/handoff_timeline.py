"""Where a hand-off's time goes, across the writer, the broker and the reader.

``handoff.py``'s ipcpool pair runs against a broker whose trace events (``ipcpool.trace``) this
module takes in: the broker imports it at start (``IPCPOOL_TRACE=bench.handoff_timeline:
broker_event``) and stamps each request as its handling begins and ends, and each directory entry.
The writer stamps its own steps and trace events (create sent, seal posted on the board, seal
sent), the reader its own (entry found, seal seen, ordered after it, lease in hand, element read).
All stamps are CLOCK_MONOTONIC, one clock for the three processes, so each hand-off becomes one
timeline; its two branches meet where the reader, holding the entry, sees the seal:

    writer:  start -> create sent -> create returns -> view and fill -> seal posted -> seal sent
    broker:           create received -> directory entry
    reader:                                 entry found ... seal seen -> ordered -> lease -> read

"Reaches the broker" is when the request, read and checked, is handed to its handler: reading a
frame and checking it (a few µs) count in the trip. The report says how often the entry was found
before the seal was posted: then the broker is off the hand-off's critical path, and the writer's
steps and the reader's after the seal are on it.

Prints each segment's p25/p50/p75 over the hand-offs and the broker's handlers (median µs), and
draws the median timeline.

    python bench/handoff_timeline.py [--backend cuda|host] [--handoffs 300] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import atexit
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# (label, from, to): the writer's moments (w_*), the broker's (b_*) and the reader's (r_*) of one hand-off.
SEGMENTS = [
    ("create: until its frame leaves", "w_start", "w_create_sent"),
    ("create reaches the broker", "w_create_sent", "b_recv_create"),
    ("broker: create to directory entry", "b_recv_create", "b_entry"),
    ("reader finds the entry", "b_entry", "r_entry"),
    ("create returns (after its frame)", "w_create_sent", "w_created"),
    ("view and fill", "w_created", "w_filled"),
    ("seal: record, post the board word", "w_filled", "w_seal_posted"),
    ("seal reaches the broker", "w_seal_sent", "b_recv_seal"),
    ("reader sees the seal", "w_seal_posted", "r_seal_seen"),
    ("reader orders after the seal", "r_seal_seen", "r_ordered"),
    ("get returns", "r_ordered", "r_got"),
    ("view and read one element", "r_got", "r_read"),
    ("whole hand-off", "w_start", "r_read"),
]


MARKS_ENV = "HANDOFF_TIMELINE_MARKS"   # where the broker's stamps go as it exits

# In the broker's process: (ns, what, op, name) per event, each handler's time per op, and the
# request being handled (the broker handles one at a time): (op, ns).
_events: list[tuple[int, str, str, str | None]] = []
_spent: dict[str, list[int]] = collections.defaultdict(list)
_handling: list = [None, 0]


def broker_event(name: str, info: dict) -> None:
    """The broker's trace callback: its events stamped (written to $HANDOFF_TIMELINE_MARKS as it exits)."""
    t = time.perf_counter_ns()
    if name == "broker.request":
        _handling[:] = info["op"], t
        _events.append((t, "recv", info["op"], info["fields"].get("name")))
    elif name == "broker.handled":
        if _handling[0] == info["op"]:
            _spent[info["op"]].append(t - _handling[1])
        _events.append((t, "done", info["op"], None))
    elif name == "broker.entry":
        _events.append((t, "entry", "create", info["name"]))


if os.environ.get(MARKS_ENV):   # imported by the broker (IPCPOOL_TRACE names broker_event)
    atexit.register(lambda: Path(os.environ[MARKS_ENV]).write_text(json.dumps({"events": _events, "spent": _spent})))


def timelines(hand_offs: list[dict], events: list) -> list[dict[str, int]]:
    """One dict of moments per hand-off: the writer's and the reader's, and the broker's between
    its start and the next hand-off's (its create and seal by name)."""
    rows = []
    starts = [m["w_start"] for m in hand_offs] + [float("inf")]
    keys = {("recv", "create"): "b_recv_create", ("done", "create"): "b_done_create",
            ("entry", "create"): "b_entry", ("recv", "seal"): "b_recv_seal"}
    i = 0
    for k, moments in enumerate(hand_offs):
        row = {key: t for key, t in moments.items() if t}   # (0: a trace event that did not come)
        while i < len(events) and events[i][0] < starts[k]:
            i += 1
        j = i
        while j < len(events) and events[j][0] < starts[k + 1]:
            t, what, op, _name = events[j]
            key = keys.get((what, op))
            if key and key not in row:
                row[key] = t
            j += 1
        rows.append(row)
    return rows


TAIL = 0.05   # the slowest hand-offs whose segments ``tail`` sets against all of them


def tail(rows: list[dict[str, int]]) -> list[dict]:
    """What makes the slowest hand-offs slow: each segment's p50 over the slowest ``TAIL`` of
    them against its p50 over all, the segments that grew most first."""
    done = sorted((r for r in rows if "r_read" in r), key=lambda r: r["r_read"] - r["w_start"])
    slow = done[int(len(done) * (1 - TAIL)):]
    out = []
    for label, a, b in SEGMENTS[:-1]:
        every = [(r[b] - r[a]) / 1000 for r in done if a in r and b in r]
        there = [(r[b] - r[a]) / 1000 for r in slow if a in r and b in r]
        if every and there:
            p50, tail_p50 = statistics.median(every), statistics.median(there)
            out.append({"label": label, "p50_us": p50, "tail_p50_us": tail_p50, "n": len(there)})
    return sorted(out, key=lambda t: t["p50_us"] - t["tail_p50_us"])


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    s = sorted(xs)
    return s[len(s) // 4], statistics.median(s), s[3 * len(s) // 4]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.patches
    import matplotlib.pyplot as plt

    rows = [r for r in result["segments"] if r["n"] and r["label"] != "whole hand-off"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    colors = {"w": "tab:blue", "b": "tab:orange", "r": "tab:green"}   # whose moment ends the segment
    ax.barh([r["label"] for r in rows], [r["p50_us"] for r in rows],
            left=[r["starts_at_us"] for r in rows], color=[colors[r["to"][0]] for r in rows])
    ax.legend(handles=[matplotlib.patches.Patch(color=c, label=who) for who, c in
                       zip(("writer", "broker", "reader"), colors.values())], loc="lower right")
    ax.invert_yaxis()
    ax.set_xlabel("µs after the writer starts (medians)")
    ax.set_title(f"one hand-off across three processes, {result['backend']} backend")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("host", "cuda"), default="cuda")
    ap.add_argument("--handoffs", type=int, default=300)
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)

    from bench import handoff
    from bench.common import broker, machine, save

    with tempfile.TemporaryDirectory(prefix="ipcpool-timeline-") as tmp:
        broker_marks, pair_marks = Path(tmp, "broker.json"), Path(tmp, "pair.json")
        env = {"IPCPOOL_TRACE": "bench.handoff_timeline:broker_event", MARKS_ENV: str(broker_marks),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        with broker(args.backend, env=env) as sock:
            os.environ["HANDOFF_MARKS"] = str(pair_marks)   # inherited by the spawned pair
            handoff.run_pair("ipcpool", handoff._ipc_producer, handoff._ipc_consumer,
                             args.handoffs + handoff.WARMUP, sock, args.backend)
        marks = json.loads(broker_marks.read_text())   # written as the broker stopped
        pair = json.loads(pair_marks.read_text())
    rows = timelines(pair, marks["events"])
    result: dict = {"benchmark": "handoff_timeline", "backend": args.backend, "machine": machine(),
                    "handoffs": len(rows), "segments": [], "handlers_us": {}}
    if args.backend == "cuda":
        from bench.common import gpu_device

        result["device"] = gpu_device()
    print(f"\n{'segment':<42}{'n':>5}{'p25 µs':>9}{'p50 µs':>9}{'p75 µs':>9}")
    for label, a, b in SEGMENTS:
        xs = [(r[b] - r[a]) / 1000 for r in rows if a in r and b in r]
        starts = [(r[a] - r["w_start"]) / 1000 for r in rows if a in r and b in r]
        seg = {"label": label, "from": a, "to": b, "n": len(xs)}
        if xs:
            p25, p50, p75 = quartiles(xs)
            seg.update(p25_us=p25, p50_us=p50, p75_us=p75, starts_at_us=statistics.median(starts))
            print(f"{label:<42}{len(xs):>5}{p25:>9.1f}{p50:>9.1f}{p75:>9.1f}")
        result["segments"].append(seg)
    whole = sorted((r["r_read"] - r["w_start"]) / 1000 for r in rows if "r_read" in r)
    asked = [(r["r_read"] - r["w_start"]) / 1000 for r in rows if "r_entry" not in r and "r_read" in r]
    woken = [(r["r_read"] - r["w_start"]) / 1000 for r in rows if r.get("r_woken") and "r_read" in r]
    if whole:
        result["whole_p99_us"] = whole[min(len(whole) - 1, len(whole) * 99 // 100)]
        result["asked_broker"] = {"n": len(asked), "p50_us": statistics.median(asked) if asked else None}
        result["woken"] = {"n": len(woken), "p50_us": statistics.median(woken) if woken else None}
        print(f"\nwhole hand-off p99 {result['whole_p99_us']:.1f} µs; {len(asked)} hand-offs read without the "
              "directory (the broker served them)" + (f", p50 {statistics.median(asked):.1f} µs" if asked else "")
              + f"; {len(woken)} waited past the reader's spin (it asked the broker to wake it)"
              + (f", p50 {statistics.median(woken):.1f} µs" if woken else ""))
    result["tail"] = tail(rows)
    if result["tail"]:
        print(f"\nin the slowest {TAIL:.0%} of hand-offs (p50 µs there against all): " + ", ".join(
            f"{t['label']} {t['tail_p50_us']:.1f} vs {t['p50_us']:.1f}" for t in result["tail"][:5]))
    both = [r for r in rows if "r_entry" in r and "w_seal_posted" in r]
    early = sum(r["r_entry"] <= r["w_seal_posted"] for r in both)
    result["entry_before_seal"] = early / len(both) if both else None
    if both:
        print(f"\nthe reader had the entry before the seal was posted in {early} of {len(both)} hand-offs "
              "(the broker off the critical path)")
    print("\nbroker handlers, median µs: " + ", ".join(
        f"{op} {statistics.median(v) / 1000:.1f} ({len(v)})" for op, v in sorted(marks["spent"].items())))
    result["handlers_us"] = {op: statistics.median(v) / 1000 for op, v in marks["spent"].items()}
    path = save(f"handoff_timeline_{args.backend}_{time.strftime('%Y%m%d-%H%M%S')}", result, plot, args.out_dir)
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
