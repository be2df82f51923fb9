"""Cost of opening peer IPC events (fresh handles vs one handle again) and of the other per-hand-off
CUDA steps, across two processes. For a GPU machine.

    python scripts/micro_events.py
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

N = 300


def p50(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] / 1000


def _child(handles, same, q):
    from cuda.core import Buffer, Device

    from ipcpool.backend.cuda_events import open_ipc

    dev = Device(0)
    dev.set_current()
    s = dev.create_stream()
    fresh, again, waits = [], [], []
    for h in handles:
        t0 = time.perf_counter_ns()
        ev = open_ipc(h)
        t1 = time.perf_counter_ns()
        s.wait(ev)
        t2 = time.perf_counter_ns()
        ev.close()
        fresh.append(t1 - t0)
        waits.append(t2 - t1)
    for _ in range(N):
        t0 = time.perf_counter_ns()
        ev = open_ipc(same)
        again.append(time.perf_counter_ns() - t0)
        ev.close()
    mem = dev.allocate(1 << 20, stream=s)
    fh = []
    for _ in range(N):
        t0 = time.perf_counter_ns()
        Buffer.from_handle(int(mem.handle) + 4096, 4096, owner=mem)
        fh.append(time.perf_counter_ns() - t0)
    import torch

    t = torch.zeros(1 << 18, dtype=torch.uint8, device="cuda")
    items = []
    for _ in range(N):
        t0 = time.perf_counter_ns()
        int(t[0].item())
        items.append(time.perf_counter_ns() - t0)
    q.put({"open fresh IPC event": p50(fresh), "open the same IPC event again": p50(again),
           "stream.wait(peer event)": p50(waits), "Buffer.from_handle (sub-range)": p50(fh),
           "torch t[0].item()": p50(items)})


def main() -> None:
    from cuda.core import Device

    from ipcpool.backend.cuda_events import record_ipc

    dev = Device(0)
    dev.set_current()
    s = dev.create_stream()
    events = [record_ipc(s) for _ in range(N + 1)]
    handles = [h for _, h in events]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(handles[:N], handles[N], q))
    p.start()
    res = q.get(timeout=120)
    p.join(30)
    for k, v in res.items():
        print(f"{k:<36} p50 {v:8.1f} µs")


if __name__ == "__main__":
    main()
