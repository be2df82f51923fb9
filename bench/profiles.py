"""Where the time goes, under cProfile: the profiles worth keeping from the hand-off, hot-attach and
growth work (for a GPU machine; each also runs with ``--backend host``).

    python bench/profiles.py handoff [--backend cuda|host] [--handoffs 300] [--out DIR]
    python bench/profiles.py attach [--backend cuda|host] [--gib 8] [--count 1024] [--slab-memory pool|vmm] [--out DIR]
    python bench/profiles.py grow [--backend cuda|host] [--start-mib 2] [--max-mib 8192] [--out DIR]

handoff  the ipcpool pair of bench/handoff.py, with the broker, the producer and the consumer each
         under cProfile: prints the p50 hand-off and each process's top functions by own time.
attach   --count objects (--gib in all) resident in a CUDA broker; three plain attaches of a fresh
         process (get_tensors), then one under cProfile: its top functions by own and by total time.
         With ``--backend host``: the objects in a host broker run under cProfile (--gib counts
         MiB there), attached by fresh processes with get_arrays; the attach's and the broker's
         tables.
grow     a growable created at --start-mib and grown by doubling to --max-mib (bench/vmm_grow.py's
         series), the grower and the broker under cProfile: each step's time and both processes'
         top functions by own time (the driver calls of a CUDA grow show as their own entries).

The .prof files stay in --out (default profile-out/) for `python -m pstats` or snakeviz.
"""

from __future__ import annotations

import argparse
import cProfile
import multiprocessing as mp
import pstats
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ipcpool  # noqa: E402

CTX = mp.get_context("spawn")


def _profiled(target, path, *args):
    prof = cProfile.Profile()
    prof.enable()
    try:
        target(*args)
    finally:
        prof.disable()
        prof.dump_stats(path)


def _profiled_broker(out: Path, backend: str):
    """A fresh broker under cProfile (its profile in ``out``/broker.prof); yields its socket dir.
    SIGINT: cProfile writes its file on a clean exit."""
    from bench.common import broker

    return broker(backend, runner=(sys.executable, "-m", "cProfile", "-o", str(out / "broker.prof"), "-m", "ipcpool"),
                  stop=signal.SIGINT)


def handoff(args) -> None:
    from bench import handoff as bench_handoff

    out, n = Path(args.out), args.handoffs
    with _profiled_broker(out, args.backend) as sock:
        go, link, acks, res = CTX.Queue(), CTX.Queue(), CTX.Queue(), CTX.Queue()
        p = CTX.Process(target=_profiled, args=(bench_handoff._ipc_producer, str(out / "producer.prof"),
                                                sock, args.backend, n, go, link, acks))
        c = CTX.Process(target=_profiled, args=(bench_handoff._ipc_consumer, str(out / "consumer.prof"),
                                                sock, args.backend, n, go, link, acks, res))
        p.start()
        c.start()
        lat = sorted(res.get(timeout=120) for _ in range(n))
        p.join(60)
        c.join(60)
    print(f"hand-off under the profiler: p50 {lat[n // 2] / 1000:.1f} µs over {n}")
    for name in ("producer", "consumer", "broker"):
        print(f"\n===== {name}: by own time =====")
        pstats.Stats(str(out / f"{name}.prof")).sort_stats("tottime").print_stats(args.top)


def _grow_profiled(sock, sizes, path, out):
    """A client growing one buffer through ``sizes`` (created at the first), under cProfile: the
    wall time of each step."""
    steps = []
    with ipcpool.connect(sock) as c:
        prof = cProfile.Profile()
        prof.enable()
        t0 = time.perf_counter_ns()
        g = c.create_growable("profile/grow", sizes[0])
        steps.append(time.perf_counter_ns() - t0)
        for size in sizes[1:]:
            t0 = time.perf_counter_ns()
            g.grow(size)
            steps.append(time.perf_counter_ns() - t0)
        prof.disable()
        prof.dump_stats(path)
        g.close()
    out.put(steps)


def grow(args) -> None:
    out = Path(args.out)
    sizes, size = [], args.start_mib << 20
    while size <= args.max_mib << 20:
        sizes.append(size)
        size *= 2
    with _profiled_broker(out, args.backend) as sock:
        q = CTX.Queue()
        p = CTX.Process(target=_grow_profiled, args=(sock, sizes, str(out / "grower.prof"), q))
        p.start()
        steps = q.get(timeout=300)
        p.join(60)
    print(f"grow steps under the profiler ({args.backend}), µs: "
          + ", ".join(f"{s >> 20} MiB {t / 1000:.0f}" for s, t in zip(sizes, steps))
          + f"; {sum(steps) / 1e6:.2f} ms in all")
    for name in ("grower", "broker"):
        print(f"\n===== {name}: by own time =====")
        pstats.Stats(str(out / f"{name}.prof")).sort_stats("tottime").print_stats(args.top)
    # The broker's own time is mostly its idle poll and start-up: its request path, by total time.
    print("\n===== broker: the grow's path by total time =====")
    path = r"ipcpool/(broker/(control|handlers|growables|notices)|backend/(stock|cuda/(growable|vmm|context)))\.py:\d+\((?!<module>)"
    pstats.Stats(str(out / "broker.prof")).sort_stats("cumulative").print_stats(path, args.top)


def _attach_profiled(sock, prefix, count, path, out, host=False):
    """A fresh worker attaching ``count`` objects under cProfile: tensors on CUDA (torch and its
    context set up first, as a worker would), numpy arrays on the host."""
    if host:
        __import__("numpy")   # a worker has numpy imported before it attaches
    else:
        import torch

        torch.cuda.init()
    with ipcpool.connect(sock) as c:
        get = c.get_arrays if host else c.get_tensors
        prof = cProfile.Profile()
        t0 = time.perf_counter_ns()
        prof.enable()
        attached = get([f"{prefix}{i:05d}" for i in range(count)])
        prof.disable()
        t1 = time.perf_counter_ns()
        prof.dump_stats(path)
        del attached
    out.put((t1 - t0) / 1e6)


def attach_host(args) -> None:
    from bench import host_attach

    out = Path(args.out)
    with _profiled_broker(out, "host") as sock:
        host_attach.child_load(sock, [args.count], args.gib << 20)
        for run in range(4):   # three plain, then the one kept (the broker's profile covers all)
            q = CTX.Queue()
            p = CTX.Process(target=_attach_profiled,
                            args=(sock, f"r{args.count}/", args.count, str(out / "attach.prof"), q, True))
            p.start()
            print(f"attach {run + 1}: {q.get(timeout=300):.1f} ms (under the profiler)", flush=True)
            p.join(60)
    st = pstats.Stats(str(out / "attach.prof"))
    st.sort_stats("tottime").print_stats(args.top)
    st.sort_stats("cumulative").print_stats(args.top)
    print("\n===== broker: by own time =====")
    pstats.Stats(str(out / "broker.prof")).sort_stats("tottime").print_stats(args.top)


def attach(args) -> None:
    if args.backend == "host":
        attach_host(args)
        return
    from bench import hot_attach
    from bench.common import broker

    out = Path(args.out)
    size = (args.gib << 30) // args.count
    with broker("cuda", f'[[pools]]\nname = "default"\nslab_memory = "{args.slab_memory}"\n') as sock:
        q = CTX.Queue()
        p = CTX.Process(target=hot_attach._load, args=(str(sock), "w/", args.count, size, q))
        p.start()
        q.get(timeout=600)
        p.join(60)
        plain = [hot_attach.fresh(hot_attach._attach, str(sock), "w/", args.count)["attach_ms"] for _ in range(3)]
        print("plain attach ms:", ", ".join(f"{x:.1f}" for x in plain), flush=True)
        q = CTX.Queue()
        p = CTX.Process(target=_attach_profiled, args=(str(sock), "w/", args.count, str(out / "attach.prof"), q))
        p.start()
        print(f"profiled attach: {q.get(timeout=300):.1f} ms", flush=True)
        p.join(60)
    st = pstats.Stats(str(out / "attach.prof"))
    st.sort_stats("tottime").print_stats(args.top)
    st.sort_stats("cumulative").print_stats(args.top)


def main() -> None:
    ap = argparse.ArgumentParser(description="Profile a hand-off or a hot attach under cProfile.")
    sub = ap.add_subparsers(dest="what", required=True)
    h = sub.add_parser("handoff", help="the hand-off benchmark's ipcpool pair, every process profiled")
    h.add_argument("--backend", default="cuda", choices=("cuda", "host"), help="broker backend (default: cuda)")
    h.add_argument("--handoffs", type=int, default=300, help="hand-offs to run (default: 300)")
    a = sub.add_parser("attach", help="a fresh process attaching to many objects")
    a.add_argument("--backend", default="cuda", choices=("cuda", "host"), help="broker backend (default: cuda)")
    a.add_argument("--gib", type=int, default=8, help="GiB of objects resident in the broker (default: 8)")
    a.add_argument("--count", type=int, default=1024, help="how many objects (default: 1024)")
    a.add_argument("--slab-memory", choices=("pool", "vmm"), default="pool",
                   help="CUDA: what the pool's slabs are, pool allocations or VMM chunks (default: pool)")
    g = sub.add_parser("grow", help="a growable grown by doubling, the grower and the broker profiled")
    g.add_argument("--backend", default="cuda", choices=("cuda", "host"), help="broker backend (default: cuda)")
    g.add_argument("--start-mib", type=int, default=2, help="the size it is created at (default: 2)")
    g.add_argument("--max-mib", type=int, default=8192, help="grown by doubling up to this (default: 8192)")
    for p in (h, a, g):
        p.add_argument("--out", default="profile-out", help="directory for the .prof files (default: profile-out)")
        p.add_argument("--top", type=int, default=25, help="functions to print per table (default: 25)")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    {"handoff": handoff, "attach": attach, "grow": grow}[args.what](args)


if __name__ == "__main__":
    main()
