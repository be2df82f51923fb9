"""Where a hand-off's time goes: the hand-off benchmark's ipcpool pair, with each step timed and
the broker, the producer and the consumer under cProfile. For a GPU machine (or --backend host).

    python scripts/profile_handoff.py [--backend cuda] [--handoffs 300] [--out DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import multiprocessing as mp
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ipcpool  # noqa: E402
from bench import handoff  # noqa: E402

CTX = mp.get_context("spawn")


def _profiled(target, path, *args):
    prof = cProfile.Profile()
    prof.enable()
    try:
        target(*args)
    finally:
        prof.disable()
        prof.dump_stats(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--handoffs", type=int, default=300)
    ap.add_argument("--out", default="profile-out")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n = args.handoffs
    with tempfile.TemporaryDirectory() as tmp:
        sock = f"{tmp}/s"
        broker = subprocess.Popen([sys.executable, "-m", "cProfile", "-o", str(out / "broker.prof"), "-m",
                                   "ipcpool", "--log-level", "WARNING", "broker", "--socket-dir", sock,
                                   "--backend", args.backend])
        while True:
            try:
                with ipcpool.connect(sock):
                    break
            except ipcpool.BrokerGone:
                time.sleep(0.05)
        go, link, acks, res = CTX.Queue(), CTX.Queue(), CTX.Queue(), CTX.Queue()
        p = CTX.Process(target=_profiled, args=(handoff._ipc_producer, str(out / "producer.prof"), sock,
                                                args.backend, n, go, link, acks))
        c = CTX.Process(target=_profiled, args=(handoff._ipc_consumer, str(out / "consumer.prof"), sock,
                                                args.backend, n, go, link, acks, res))
        p.start()
        c.start()
        lat = sorted(res.get(timeout=120) for _ in range(n))
        p.join(60)
        c.join(60)
        broker.terminate()
        broker.wait(60)
    print(f"hand-off under the profiler: p50 {lat[n // 2] / 1000:.1f} µs over {n}")
    for name in ("producer", "consumer", "broker"):
        print(f"\n===== {name}: per hand-off, by own time =====")
        st = pstats.Stats(str(out / f"{name}.prof"))
        st.sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
