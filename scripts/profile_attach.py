"""Where a hot attach's time goes: 1024 objects (or --count) resident in a CUDA broker, then a fresh
process attaches with ``get_tensors`` under cProfile, after one unprofiled attach for the plain time.

    python scripts/profile_attach.py [--gib 8] [--count 1024] [--out DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import multiprocessing as mp
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import hot_attach  # noqa: E402
from bench.common import broker  # noqa: E402

CTX = mp.get_context("spawn")


def _attach_profiled(sock, prefix, count, path, out):
    import torch

    import ipcpool

    torch.cuda.init()
    with ipcpool.connect(sock) as c:
        prof = cProfile.Profile()
        t0 = time.perf_counter_ns()
        prof.enable()
        tensors = c.get_tensors([f"{prefix}{i:05d}" for i in range(count)])
        prof.disable()
        t1 = time.perf_counter_ns()
        prof.dump_stats(path)
        del tensors
    out.put((t1 - t0) / 1e6)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=int, default=8)
    ap.add_argument("--count", type=int, default=1024)
    ap.add_argument("--out", default="profile-out")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    size = (args.gib << 30) // args.count
    with broker("cuda") as sock:
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
    st.sort_stats("tottime").print_stats(25)
    st.sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
