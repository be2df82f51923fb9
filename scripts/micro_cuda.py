"""Per-call cost of the steps a CUDA hand-off takes, in one client process against a broker.

    python scripts/micro_cuda.py   (on a GPU machine)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ipcpool  # noqa: E402
from bench.common import broker  # noqa: E402


def timeit(label, fn, n=300):
    for _ in range(20):
        fn()
    xs = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        xs.append(time.perf_counter_ns() - t0)
    xs.sort()
    print(f"{label:<44} p50 {xs[n // 2] / 1000:9.1f} µs   p90 {xs[n * 9 // 10] / 1000:9.1f} µs", flush=True)


def main() -> None:
    import torch
    from cuda.core import Device

    from ipcpool.backend.cuda import context as cb
    from ipcpool.backend.cuda import driver as drv
    from ipcpool.backend.cuda.events import record_ipc

    dev = Device(0)
    dev.set_current()
    core_stream = dev.create_stream()
    tstream = torch.cuda.Stream()
    timeit("cuCtxGetCurrent", drv.current_context)
    timeit("Device(0).set_current()", lambda: Device(0).set_current())

    def on_device():
        with cb.OnDevice(0):
            pass

    timeit("OnDevice enter+exit", on_device)
    timeit("record fresh IPC event", lambda: record_ipc(core_stream)[0].close())
    x = torch.ones(16, device="cuda")
    timeit("tensor[0].item() (nothing to wait for)", lambda: x[0].item())
    with broker("cuda") as sock, ipcpool.connect(sock) as c:
        timeit("ping round trip", lambda: c._channel.call("ping"))
        timeit("allocate+free (core stream)", lambda: c.allocate(1 << 20, stream=core_stream).free(stream=core_stream))
        timeit("allocate+free (torch stream)", lambda: c.allocate(1 << 20, stream=tstream).free(stream=tstream))
        timeit("allocate+free (no stream)", lambda: c.allocate(1 << 20).free())
        buf = c.allocate(1 << 20, stream=tstream)
        timeit("torch.from_dlpack(buf)", lambda: torch.from_dlpack(buf))
        timeit("client stream(torch stream)", lambda: c._backend.stream(tstream, 0))
        buf.free(stream=tstream)
        i = iter(range(10**6))

        def create_seal_get_release_delete():
            name = f"m/{next(i)}"
            b = c.create(name, 1 << 20, stream=tstream)
            b.seal(stream=tstream)
            lease = c.get(name, stream=tstream)
            lease.release(stream=tstream)
            c.delete(name)

        timeit("create+seal+get+release+delete", create_seal_get_release_delete, n=200)
        j = iter(range(10**6))
        timeit("create", lambda: c.create(f"n/{next(j)}", 1 << 20, stream=tstream).free(stream=tstream), n=200)
        tstream.synchronize()
        with ipcpool.connect(sock) as reader:
            rstream = torch.cuda.Stream()
            steps = {k: [] for k in ("create", "fill", "seal", "get", "dlpack_device", "__dlpack__",
                                     "from_dlpack(capsule)", "as_tensor(CAI)", "item", "release", "delete")}
            for k in range(300):
                name = f"s/{k}"
                t = [time.perf_counter_ns()]
                b = c.create(name, 1 << 20, stream=tstream)
                t.append(time.perf_counter_ns())
                with torch.cuda.stream(tstream):
                    torch.from_dlpack(b).view(torch.uint8).fill_(k % 251)
                t.append(time.perf_counter_ns())
                b.seal(stream=tstream)
                t.append(time.perf_counter_ns())
                lease = reader.get(name, stream=rstream)
                t.append(time.perf_counter_ns())
                with torch.cuda.stream(rstream):
                    lease.__dlpack_device__()
                    t.append(time.perf_counter_ns())
                    cap = lease.__dlpack__(stream=rstream.cuda_stream)
                    t.append(time.perf_counter_ns())
                    x = torch.from_dlpack(cap).view(torch.uint8)
                    t.append(time.perf_counter_ns())
                    torch.as_tensor(lease, device="cuda")
                    t.append(time.perf_counter_ns())
                    assert int(x[0].item()) == k % 251
                t.append(time.perf_counter_ns())
                lease.release(stream=rstream)
                t.append(time.perf_counter_ns())
                c.delete(name)
                t.append(time.perf_counter_ns())
                for (key, a, b2) in zip(steps, t, t[1:]):
                    steps[key].append(b2 - a)
            print("hand-off steps in one process, p50 µs:",
                  ", ".join(f"{k} {sorted(v)[150] / 1000:.1f}" for k, v in steps.items()), flush=True)


if __name__ == "__main__":
    main()
