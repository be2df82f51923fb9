"""What it costs to turn ipcpool memory into a torch tensor, per call: DLPack through cuda.core's
Buffer, the CUDA Array Interface, and slicing one tensor made once (how get_tensors takes slab
ranges). One process, no broker: the costs are all local.

    python scripts/micro_dlpack.py [--iters 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time


def timed(fn, iters: int) -> float:
    xs = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        xs.append(time.perf_counter_ns() - t0)
    return statistics.median(xs) / 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    n = ap.parse_args().iters
    import torch
    from cuda.core import Buffer

    from ipcpool.backend.cuda import CudaMemory

    base = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    ptr, size = base.data_ptr(), base.numel()

    class Cai:
        __cuda_array_interface__ = {"version": 3, "shape": (size,), "typestr": "|u1", "data": (ptr, False),
                                    "strides": None, "stream": None}

    mem = CudaMemory(Buffer.from_handle(ptr, size), size, 0)
    rows = {
        "Buffer.from_handle": timed(lambda: Buffer.from_handle(ptr, size), n),
        "torch.from_dlpack(CudaMemory.dlpack())": timed(lambda: torch.from_dlpack(mem.dlpack()), n),
        "torch.as_tensor(CAI)": timed(lambda: torch.as_tensor(Cai(), device="cuda"), n),
        "slice of one tensor + view": timed(lambda: base[4096:8192].view(torch.uint8), n),
    }
    for k, v in rows.items():
        print(f"{k:<42}{v:>8.1f} µs")


if __name__ == "__main__":
    main()
