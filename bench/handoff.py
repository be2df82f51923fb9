"""Hand-off latency: a producer creates, fills and seals a fresh 1 MiB object; a consumer process
gets it and reads one element. p50/p99 over N hand-offs, side by side with the peers in one run.

    python bench/handoff.py --backend host   # vs multiprocessing.shared_memory
    python bench/handoff.py --backend cuda   # vs torch.multiprocessing and cuda.core IPC buffers

The lines take turns: each one's hand-offs run in rounds (--rounds, default 10), one line at a
time, so that a drift of the machine meets every line alike (``bench.turns``).

Every run also times the floor: the same hand-off written by hand with everything set up once
(memory imported once, events recycled, the host polling the event, a notice over AF_UNIX). The
floor and the peers live in bench/handoff_peers.py; this module has the ipcpool pair and the run.

Latency is from the producer's first call to the consumer holding the element (CLOCK_MONOTONIC is
one clock for every process). The step report (stderr) splits ipcpool's hand-off into the writer's
and the reader's calls; then a reader that asks only once the object is sealed (its get and view
wait for nothing: the reader's own cost), and how many hand-offs the reader read without the
directory, where any (the broker served them), and how many waited past the reader's spin (it asked
the broker to wake it), with their p50s.
Writes bench/results/handoff_<backend>.json and .png.

With --writer-late-ms each producer starts that long after its consumer asked, and every consumer
sleeps meanwhile (ipcpool's past its spin, the floor's in the kernel): the hand-off to a reader that
arrived before the create. With --writer-busy-ms each producer works that long on its CPU after its
fill, before it hands off: ipcpool's reader sleeps on the object's seal-board word past its spin.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import broker, machine, paired_bars, percentiles, save  # noqa: E402
from bench.handoff_peers import (  # noqa: E402
    SIZE, WARMUP, core_consumer, core_producer, devices, first_reader, floor_consumer, floor_producer,
    report_steps, shm_consumer, shm_producer, torch_consumer, torch_producer, wait_go, writer_busy)
from bench.turns import Pair  # noqa: E402
from ipcpool.progress import Progress  # noqa: E402

CTX = mp.get_context("spawn")


# The ipcpool pair then hands off LATE objects more, untimed in the figures, whose reader asks only
# once the seal is done: its get (lookup, lease, event query) and view then wait for nothing, and
# their step report is the reader's own cost.
LATE = 250

# Each line's hand-offs in ten rounds, the lines taking turns (``bench.turns``): the machine's drift
# meets every line alike.
ROUNDS = 10

# Every pair speaks through four queues: go (consumer -> producer: ready for the next), link
# (producer -> consumer: t0, and the object itself where the peer passes it that way), acks
# (consumer -> producer: done, the producer may free) and out (consumer -> parent: latency, ns).

# -- ipcpool ---------------------------------------------------------------------------------------
def _ipc_producer(socket_dir, backend, n, go, link, acks):
    import ipcpool
    from ipcpool import trace

    stream = None
    with ipcpool.connect(socket_dir) as c:
        if backend.startswith("cuda"):
            import torch

            torch.cuda.set_device(devices(backend)[0])
            stream = torch.cuda.Stream()
            torch.cuda.set_stream(stream)   # the worker's stream for all its work, set once
        fill = bytes(SIZE)
        steps = []
        sent = {"client.create_sent": 0, "client.seal_posted": 0, "client.seal_sent": 0}
        timeline = bool(os.environ.get("HANDOFF_MARKS"))   # (bench/handoff_timeline.py: every moment)

        def stamp(event, _info):   # when the create and the seal leave (neither waits for a reply)
            if event in sent:
                sent[event] = time.perf_counter_ns()

        if os.environ.get("HANDOFF_SENT_STAMPS") or timeline:   # (--sent-stamps: ~15 trace events a hand-off)
            trace.set_trace(stamp)
        ab = NativeAB.asked("writer")
        for i in range(n + LATE):
            if ab is not None:
                ab.pick(i)
            wait_go(go)
            sent["client.create_sent"] = sent["client.seal_posted"] = sent["client.seal_sent"] = 0
            t0 = time.perf_counter_ns()
            buf = c.create(f"h/{i}", SIZE, stream=stream)
            t1 = time.perf_counter_ns()
            if stream is not None:
                x = buf.tensor()   # (bytes: no dtype in the metadata)
                t_view = time.perf_counter_ns()
                x.fill_(i % 251)
            else:
                x = buf.view
                t_view = time.perf_counter_ns()
                x[:] = fill
                x[0] = i % 251
            del x
            writer_busy()
            t2 = time.perf_counter_ns()
            buf.seal(stream=stream)
            t3 = time.perf_counter_ns()
            moments = None
            if timeline:
                moments = {"w_start": t0, "w_create_sent": sent["client.create_sent"], "w_created": t1,
                           "w_filled": t2, "w_seal_posted": sent["client.seal_posted"],
                           "w_seal_sent": sent["client.seal_sent"], "w_sealed": t3}
            link.put((t0, sent["client.seal_sent"] or t3, sent["client.create_sent"] or t1, moments))
            if i < n:
                own = (t1 - t0) + (t_view - t1) + (t3 - t2)   # the writer's create + view + seal
                steps.append((t1 - t0, t_view - t1, t2 - t_view, t3 - t2, own))
                if ab is not None and i >= WARMUP:
                    ab.own(i, own)
            acks.get()
            c.delete(f"h/{i}")
        report_steps("producer", ("create", "view", "fill", "seal", "create+view+seal"), steps)
        if ab is not None:
            ab.report("producer")


def _ipc_consumer(socket_dir, backend, n, go, link, acks, out):
    import ipcpool

    stream = None
    with ipcpool.connect(socket_dir) as c:
        if backend.startswith("cuda"):
            import torch

            consumer = devices(backend)[1]
            torch.cuda.set_device(consumer)   # its stream, and the reads, on the consumer's GPU
            stream = torch.cuda.Stream()
            torch.cuda.set_stream(stream)
            read_first = first_reader(backend)
        steps, marks, late, asked, slept = [], [], [], [], []
        seen: dict[str, int] = {}
        ab = NativeAB.asked("reader") or NativeAB.asked("writer")   # (the writer's: its halves timed here)
        if os.environ.get("HANDOFF_MARKS"):   # the reader's own moments, from its trace events
            from ipcpool import trace

            names = {"client.entry_found": "r_entry", "client.seal_seen": "r_seal_seen", "client.ordered": "r_ordered"}

            def stamp(event, _info):
                if event in names:
                    seen[names[event]] = time.perf_counter_ns()

            trace.set_trace(stamp)
        for i in range(n + LATE):
            if ab is not None and ab.side == "reader":
                ab.pick(i)
            seen.clear()
            go.put(True)
            if i >= n:   # asked once sealed: the reader's own cost
                link.get()
            wakes = c._handoff.wakes_sent
            t_asked = time.perf_counter_ns()
            lease = c.get(f"h/{i}", stream=stream, timeout=60)
            t_got = time.perf_counter_ns()
            x = lease.tensor() if stream is not None else lease.view
            t_view = time.perf_counter_ns()
            value = read_first(x) if stream is not None else x[0]
            del x
            t1 = time.perf_counter_ns()
            assert value == i % 251, (value, i)
            from_directory = lease.dirlease is not None   # (else the broker served it)
            woken = c._handoff.wakes_sent != wakes          # (it waited past its spin: the broker woke it)
            lease.release(stream=stream)
            if i >= n:
                late.append((t_got - t_asked, t_view - t_got, t_view - t_asked))
                if ab is not None and ab.side == "reader":
                    ab.own(i, t_got - t_asked)
            else:
                t0, t_sent, t_create, moments = link.get()
                steps.append((t_got - t0, t_got - t_sent, t_view - t_got, t1 - t_view))
                if i >= WARMUP:   # (counted as the figures are)
                    if not from_directory:
                        asked.append(t1 - t0)
                    if woken:
                        slept.append(t1 - t0)
                if moments is not None:
                    marks.append({**moments, **seen, "r_asked": t_asked, "r_got": t_got, "r_read": t1,
                                  "r_woken": woken})
                out.put(t1 - t0)
                if ab is not None and i >= WARMUP:
                    ab.timed(i, t_got - t0, t1 - t0)
            acks.put(True)
        names = ("start->got lease", "seal sent->got lease", "view", "read")
        if not os.environ.get("HANDOFF_SENT_STAMPS"):   # (the seal's moment is t1 of seal(): not shown)
            names, steps = names[::2] + names[3:], [(s[0], s[2], s[3]) for s in steps]
        report_steps("consumer", names, steps)
        report_steps("consumer", ("get once sealed", "its view", "get+view"), late)
        if ab is not None:
            ab.report("consumer")
        # The hand-offs a broker's answer served, and those whose reader outwaited its spin.
        for xs, what in ((asked, "read without the directory (the broker served them)"),
                         (slept, "waited past the reader's spin (it asked the broker to wake it)")):
            if xs:
                p50 = sorted(xs)[len(xs) // 2] / 1000
                sys.stderr.write(f"  consumer: {len(xs)} of {n - WARMUP} hand-offs {what}, p50 {p50:.1f} µs\n")
    if os.environ.get("HANDOFF_MARKS"):   # each hand-off's moments, for bench/handoff_timeline.py
        Path(os.environ["HANDOFF_MARKS"]).write_text(json.dumps(marks[WARMUP:]))


class NativeAB:
    """--reader-ab / --writer-ab: one side's hot calls in C (``ipcpool/shm/_native.c``) on even
    hand-offs and in Python on odd ones (the reader's directory lookup and its one-call take; the
    writer's ring puts and its seal's record and post), in the one process: each half's p50, free
    of the drift between two runs. The consumer times both halves; a writer also its create + view + seal."""

    SAYS = {"reader": "lookup", "writer": "calls"}

    def __init__(self, side: str):
        from ipcpool.shm import native

        if not native.built(side):
            raise SystemExit(f"--{side}-ab: ipcpool.shm._native is not built here (pip install . with a C compiler)")
        self.side, self._native = side, native
        self._xs: dict[str, list[list[int]]] = {"C": [[], [], []], "Python": [[], [], []]}

    @classmethod
    def asked(cls, side: str) -> NativeAB | None:
        return cls(side) if os.environ.get("HANDOFF_AB") == side else None

    @staticmethod
    def half(i: int) -> str:
        return "C" if i % 2 == 0 else "Python"

    def pick(self, i: int) -> None:
        self._native.use(self.side, i % 2 == 0)

    def timed(self, i: int, got_ns: int, whole_ns: int) -> None:
        xs = self._xs[self.half(i)]
        xs[0].append(got_ns)
        xs[1].append(whole_ns)

    def own(self, i: int, ns: int) -> None:   # the reader's get once sealed; the writer's create + view + seal
        self._xs[self.half(i)][2].append(ns)

    def report(self, who: str) -> None:
        for half, (got, whole, own) in self._xs.items():
            p50 = [sorted(xs)[len(xs) // 2] / 1000 if xs else float("nan") for xs in (got, whole, own)]
            if who == "producer":
                line = f"writer with its {half} calls: create+view+seal p50 {p50[2]:.1f} µs ({len(own)})"
            else:
                line = (f"{self.side} with the {half} {self.SAYS[self.side]}: start->got lease p50 {p50[0]:.1f} µs, "
                        f"whole {p50[1]:.1f} µs ({len(got)} hand-offs)")
                if self.side == "reader":
                    line += f"; get once sealed {p50[2]:.1f} µs ({len(own)})"
            sys.stderr.write(f"  {line}\n")


def run_pair(label, producer, consumer, n, socket_dir=None, backend=None, pipe=False) -> dict:
    """One pair alone, its ``n`` hand-offs in one go (what the timeline and the A/B runs take)."""
    return run_in_turns([Pair(CTX, label, producer, consumer, n, 1, socket_dir, backend, pipe)])[label]


def run_in_turns(pairs: list[Pair]) -> dict[str, dict]:
    """The pairs started and set up, then their hand-offs in rounds, one pair at a time
    (``bench.turns``); each one's figures (warm-up left out) and step p50s."""
    results: dict[str, dict] = {}
    try:
        for pair in pairs:
            pair.start()
        for pair in pairs:
            pair.wait_ready()
        rounds = len(pairs[0].bounds) - 1
        label = pairs[0].label if len(pairs) == 1 else f"{len(pairs)} lines in {rounds} rounds"
        with Progress(label, sum(p.n for p in pairs), stream=sys.stdout) as bar:
            for k in range(rounds):
                for pair in pairs:
                    pair.round(k, bar.update)
        for pair in pairs:   # (one at a time: a pair's untimed hand-offs run alone)
            steps, means = pair.finish(), pair.finish("mean_us")
            results[pair.label] = {**percentiles(pair.samples[WARMUP:]),
                                   **({"steps_p50_us": steps, "steps_mean_us": means} if steps else {})}
    finally:
        for pair in pairs:
            pair.stop()
    return results


def plot(results: dict, path: Path) -> None:
    names = list(results["peers"])
    paired_bars(path, names, {q: [results["peers"][k][f"{q}_us"] for k in names] for q in ("p50", "p99")},
                f"hand-off latency ({results['backend']}"
                + (f", writer {results['writer_late_ms']:g} ms late" if results.get("writer_late_ms") else "")
                + (f", writer busy {results['writer_busy_ms']:g} ms" if results.get("writer_busy_ms") else "") + ")",
                "µs per 1 MiB hand-off")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("host", "cuda"), default="host")
    parser.add_argument("--handoffs", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help=f"each line's hand-offs in this many rounds, the lines taking turns (default {ROUNDS}; "
                             "1: each line in one go, one after another, as --reader-ab and --writer-ab run)")
    parser.add_argument("--no-spin-too", action="store_true",
                        help="also run ipcpool with busy polling off, for the difference it makes")
    parser.add_argument("--sent-stamps", action="store_true",
                        help="trace when the writer's create and seal leave (a trace callback in the timed "
                             "writer: ~15 events a hand-off) and show seal sent -> got lease")
    parser.add_argument("--reader-ab", action="store_true",
                        help="the ipcpool reader alternates its directory lookup in C and in Python, hand-off "
                             "by hand-off, and reports each (needs ipcpool's C part built)")
    parser.add_argument("--writer-ab", action="store_true",
                        help="the same for the ipcpool writer's ring puts and its seal's record and post")
    parser.add_argument("--skip", default="", help="comma-separated lines to leave out: floor, cuda.core")
    parser.add_argument("--devices", default=None, metavar="P,C",
                        help="CUDA: the producer on GPU P, the consumer on GPU C reading it through "
                             "peer access (ipcpool and torch.multiprocessing; the floor and cuda.core "
                             "lines are same-GPU only and left out)")
    parser.add_argument("--writer-late-ms", type=float, default=0, metavar="MS",
                        help="each producer starts MS after its consumer asks, which sleeps meanwhile (a "
                             "reader that arrives before the create; the floor's reader asleep in the "
                             "kernel); results go to bench/out/handoff_<backend>_late.json")
    parser.add_argument("--writer-busy-ms", type=float, default=0, metavar="MS",
                        help="each producer works MS on its CPU after its fill, before it hands off (ipcpool's "
                             "reader, which found the object at its create, waits for the seal past its "
                             "spin); results go to bench/out/handoff_<backend>_busy.json")
    parser.add_argument("--out-dir", type=Path, default=None, help="where the JSON and PNG go (default bench/results)")
    args = parser.parse_args()
    for key, value in (("writer-late-ms", args.writer_late_ms), ("writer-busy-ms", args.writer_busy_ms)):
        if value < 0:
            parser.error(f"--{key} is 0 or more")
        if value:   # (inherited by the spawned pairs)
            os.environ[f"HANDOFF_{key.upper().replace('-', '_')}"] = str(value)
    skip = set(filter(None, args.skip.split(",")))
    if skip - {"floor", "cuda.core"}:   # (ipcpool and the usual peer are what the figures compare)
        parser.error(f"--skip takes floor and cuda.core, got {', '.join(sorted(skip - {'floor', 'cuda.core'}))}")
    if args.sent_stamps:
        os.environ["HANDOFF_SENT_STAMPS"] = "1"   # (inherited by the spawned pair)
    if args.reader_ab and args.writer_ab:
        parser.error("--reader-ab or --writer-ab, one at a time")
    if args.reader_ab or args.writer_ab:
        os.environ["HANDOFF_AB"] = "reader" if args.reader_ab else "writer"
    tag = args.backend   # what the pairs are told: "cuda:P,C" puts the two on GPUs P and C
    pool = '[[pools]]\nname = "default"\nmax_size = "4G"\n'
    if args.devices:
        if args.backend != "cuda":
            parser.error("--devices is for --backend cuda")
        tag = f"cuda:{args.devices}"
        try:
            producer, consumer = devices(tag)
        except ValueError:
            parser.error(f"--devices takes two GPU numbers, P,C; got {args.devices!r}")
        pool += f"device = {producer}\n" + (f"peer_access = [{consumer}]\n" if consumer != producer else "")
        if consumer != producer:
            skip |= {"floor", "cuda.core"}
    n = args.handoffs + WARMUP
    if args.reader_ab or args.writer_ab:   # (halves of one pair's hand-offs, alternated: one go)
        args.rounds = 1
    if not 1 <= args.rounds <= args.handoffs:
        parser.error(f"--rounds is 1 to --handoffs ({args.handoffs}), got {args.rounds}")
    results = {"benchmark": "handoff", "backend": args.backend, "machine": machine(), "handoffs": args.handoffs,
               "rounds": args.rounds,
               "object_bytes": SIZE, "writer_late_ms": args.writer_late_ms,
               "writer_busy_ms": args.writer_busy_ms, "peers": {}}
    if args.backend == "cuda":
        from bench.common import gpu_device

        results["device"] = gpu_device()
        results["devices"] = list(devices(tag))
    with contextlib.ExitStack() as stack:
        socket_dir = stack.enter_context(broker(args.backend, pool))
        pairs = [Pair(CTX, "ipcpool", _ipc_producer, _ipc_consumer, n, args.rounds, socket_dir, tag)]
        if args.no_spin_too:   # the same without busy polling (broker busy_poll_us = 0, clients' spin 0)
            quiet = stack.enter_context(broker(args.backend, "busy_poll_us = 0\n" + pool))
            pairs.append(Pair(CTX, "ipcpool, no busy polling", _ipc_producer, _ipc_consumer, n, args.rounds, quiet, tag,
                              env={"IPCPOOL_CLIENT_SPIN_US": "0"}))
        if "floor" not in skip:
            pairs.append(Pair(CTX, "floor", floor_producer, floor_consumer, n, args.rounds, None, args.backend, pipe=True))
        if args.backend == "host":
            pairs.append(Pair(CTX, "shared_memory", shm_producer, shm_consumer, n, args.rounds))
        else:
            pairs.append(Pair(CTX, "torch.multiprocessing", torch_producer, torch_consumer, n, args.rounds, None, tag))
            if "cuda.core" not in skip:
                pairs.append(Pair(CTX, "cuda.core", core_producer, core_consumer, n, args.rounds))
        peers = results["peers"] = run_in_turns(pairs)
        import ipcpool

        with ipcpool.connect(socket_dir) as c:   # the broker's own time from a create's receipt to its entry
            results["broker"] = c.stats().get("handoff", {})
    peer = "shared_memory" if args.backend == "host" else "torch.multiprocessing"
    for row in peers.values():   # each line against the floor and the usual peer
        row["x_floor"] = row["p50_us"] / peers["floor"]["p50_us"] if "floor" in peers else None
        row[f"speedup_vs_{peer}"] = peers[peer]["p50_us"] / row["p50_us"]
    base = peers["ipcpool"]["p50_us"]
    results["speedup_p50"] = {k: v["p50_us"] / base for k, v in peers.items() if not k.startswith("ipcpool")}
    name, out_dir = f"handoff_{args.backend}", args.out_dir
    if args.writer_late_ms or args.writer_busy_ms:   # (not the usual hand-off: kept out of bench/results)
        name = name + ("_late" if args.writer_late_ms else "") + ("_busy" if args.writer_busy_ms else "")
        out_dir = out_dir or Path(__file__).resolve().parent / "out"
    path = save(name, results, plot, *([out_dir] if out_dir else []))
    print(f"\n{'':<26}{'p50 µs':>9}{'p99 µs':>9}{'x floor':>9}{'  vs ' + peer.split('.')[0]:>14}")
    for k, v in peers.items():
        x_floor = "-" if v["x_floor"] is None else f"{v['x_floor']:.2f}"
        print(f"{k:<26}{v['p50_us']:>9.1f}{v['p99_us']:>9.1f}{x_floor:>9}{v[f'speedup_vs_{peer}']:>13.2f}x")
    b = results.get("broker", {})
    if b.get("creates"):
        print(f"broker: create received -> directory entry p50 {b['create_to_entry_p50_us']:.1f} µs, "
              f"p99 {b['create_to_entry_p99_us']:.1f} µs over its last {b['creates']} creates")
    print(f"-> {path}")


if __name__ == "__main__":
    main()
