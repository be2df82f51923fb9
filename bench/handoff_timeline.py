"""Where a hand-off's time goes, across the writer, the broker and the reader.

``handoff.py``'s ipcpool pair runs against a broker that stamps every message it takes in, every
message it sends and how long each handler ran; the reader keeps each hand-off's moments (the
writer's start, its create and seal leaving, the pending answer, the lease in hand). All stamps
are CLOCK_MONOTONIC, one clock for the three processes, so each hand-off becomes one timeline:

    start -> create sent -> broker has the create -> broker answers the reader (pending) ->
    reader has the answer -> reader has the lease;   seal sent -> broker has the seal -> ...

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

# (label, from, to): the moments are the reader's (r_*) or the broker's (b_*) for one hand-off.
SEGMENTS = [
    ("create leaves the writer", "r_start", "r_create"),
    ("create reaches the broker", "r_create", "b_recv_create"),
    ("broker handles the create", "b_recv_create", "b_done_create"),
    ("pending answer sent (from the create)", "b_recv_create", "b_send_pending"),
    ("pending answer reaches the reader", "b_send_pending", "r_answered"),
    ("seal leaves the writer (from start)", "r_start", "r_seal"),
    ("seal reaches the broker", "r_seal", "b_recv_seal"),
    ("reader has the lease (from the answer)", "r_answered", "r_got"),
    ("whole hand-off", "r_start", "r_got"),
]


def broker_child(marks_path: str, cli_args: list[str]) -> int:
    """ipcpool's command line (a broker) with the broker's messages and handlers stamped; the
    stamps go to ``marks_path`` as it exits."""
    from ipcpool import cli, frames, protocol
    from ipcpool.broker import handlers, server

    events: list[tuple[int, str, str, str | None]] = []
    spent: dict[str, list[int]] = collections.defaultdict(list)
    on_message, send, reply = server.Broker._on_message, server.Broker.send, server.Broker._reply
    on_frame = server.Broker._on_frame

    def stamped_on_message(self, frames, *rest):
        try:
            msg = protocol.unpack(frames[1])
            op, name = str(msg.get("op")), msg.get("name")
        except Exception:   # a malformed message is the broker's to refuse, as always
            op, name = "?", None
        events.append((time.perf_counter_ns(), "recv", op, name))
        try:
            return on_message(self, frames, *rest)
        finally:
            events.append((time.perf_counter_ns(), "done", op, name))

    def stamped_on_frame(self, session, data):   # a create or seal sent as a frame (``ipcpool.frames``)
        try:
            op, fields = frames.parse(data)
            name = fields.get("name")
        except Exception:
            op, name = "?", None
        events.append((time.perf_counter_ns(), "recv", op, name))
        try:
            return on_frame(self, session, data)
        finally:
            events.append((time.perf_counter_ns(), "done", op, name))

    def stamped_send(self, ident, msg):
        kind = msg.get("notify") or ("pending" if msg.get("pending") else "reply")
        events.append((time.perf_counter_ns(), "send", kind, None))
        return send(self, ident, msg)

    def stamped_reply(self, session, op, rid, fields):   # an answer (the outbox sends it packed)
        events.append((time.perf_counter_ns(), "send", "pending" if fields.get("pending") else "reply", None))
        return reply(self, session, op, rid, fields)

    def timed(name):
        inner = getattr(handlers.Handlers, name)

        def run(*args, **kwargs):
            t = time.perf_counter_ns()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[name].append(time.perf_counter_ns() - t)
        setattr(handlers.Handlers, name, run)

    server.Broker._on_message, server.Broker.send, server.Broker._reply = stamped_on_message, stamped_send, stamped_reply
    server.Broker._on_frame = stamped_on_frame
    for name in [n for n in vars(handlers.Handlers) if n.startswith("op_")]:
        timed(name)
    atexit.register(lambda: Path(marks_path).write_text(json.dumps({"events": events, "spent": spent})))
    return cli.main(cli_args)


def timelines(reader: list, events: list) -> list[dict[str, int]]:
    """One dict of moments per hand-off: the reader's, and the broker's between its start and the next."""
    rows = []
    starts = [m[0] for m in reader] + [float("inf")]
    i = 0
    for k, (start, create, seal, answered, got) in enumerate(reader):
        row = {"r_start": start, "r_create": create, "r_seal": seal, "r_answered": answered, "r_got": got}
        while i < len(events) and events[i][0] < start:
            i += 1
        j = i
        while j < len(events) and events[j][0] < starts[k + 1]:
            t, what, op, _name = events[j]
            key = {("recv", "create"): "b_recv_create", ("done", "create"): "b_done_create",
                   ("recv", "seal"): "b_recv_seal", ("send", "pending"): "b_send_pending"}.get((what, op))
            if key and key not in row:
                row[key] = t
            j += 1
        rows.append(row)
    return rows


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    s = sorted(xs)
    return s[len(s) // 4], statistics.median(s), s[3 * len(s) // 4]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["segments"] if r["n"] and r["label"] != "whole hand-off"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.barh([r["label"] for r in rows], [r["p50_us"] for r in rows],
            left=[r["starts_at_us"] for r in rows], color="tab:blue")
    ax.invert_yaxis()
    ax.set_xlabel("µs after the writer starts (medians)")
    ax.set_title(f"one hand-off across three processes, {result['backend']} backend")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--broker-child"]:   # the broker: --broker-child MARKS, then ipcpool's arguments
        return broker_child(argv[1], argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("host", "cuda"), default="cuda")
    ap.add_argument("--handoffs", type=int, default=300)
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)

    from bench import handoff
    from bench.common import broker, machine, save

    with tempfile.TemporaryDirectory(prefix="ipcpool-timeline-") as tmp:
        broker_marks, reader_marks = Path(tmp, "broker.json"), Path(tmp, "reader.json")
        with broker(args.backend, runner=(sys.executable, __file__, "--broker-child", str(broker_marks))) as sock:
            os.environ["HANDOFF_MARKS"] = str(reader_marks)   # inherited by the spawned pair
            handoff.run_pair("ipcpool", handoff._ipc_producer, handoff._ipc_consumer,
                             args.handoffs + handoff.WARMUP, sock, args.backend)
        marks = json.loads(broker_marks.read_text())   # written as the broker stopped
        reader = json.loads(reader_marks.read_text())
    rows = timelines(reader, marks["events"])
    result: dict = {"benchmark": "handoff_timeline", "backend": args.backend, "machine": machine(),
                    "handoffs": len(rows), "segments": [], "handlers_us": {}}
    if args.backend == "cuda":
        from bench.common import gpu_device

        result["device"] = gpu_device()
    print(f"\n{'segment':<42}{'n':>5}{'p25 µs':>9}{'p50 µs':>9}{'p75 µs':>9}")
    for label, a, b in SEGMENTS:
        xs = [(r[b] - r[a]) / 1000 for r in rows if a in r and b in r]
        starts = [(r[a] - r["r_start"]) / 1000 for r in rows if a in r and b in r]
        seg = {"label": label, "from": a, "to": b, "n": len(xs)}
        if xs:
            p25, p50, p75 = quartiles(xs)
            seg.update(p25_us=p25, p50_us=p50, p75_us=p75, starts_at_us=statistics.median(starts))
            print(f"{label:<42}{len(xs):>5}{p25:>9.1f}{p50:>9.1f}{p75:>9.1f}")
        result["segments"].append(seg)
    print("\nbroker handlers, median µs: " + ", ".join(
        f"{op[3:]} {statistics.median(v) / 1000:.1f} ({len(v)})" for op, v in sorted(marks["spent"].items())))
    result["handlers_us"] = {op[3:]: statistics.median(v) / 1000 for op, v in marks["spent"].items()}
    path = save(f"handoff_timeline_{args.backend}_{time.strftime('%Y%m%d-%H%M%S')}", result, plot, args.out_dir)
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
