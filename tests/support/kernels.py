"""Small cupy kernels the GPU tests run inside their client processes (cupy is imported lazily,
so collecting the tests needs no GPU)."""

from __future__ import annotations

import numpy as np

SPIN_SRC = r"""
extern "C" __global__ void spin_fill(unsigned char* p, unsigned long long n, long long cycles,
                                     unsigned char v) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        p[i] = v;
}
"""
_kernel = None


def spin_fill(ptr: int, n: int, seconds: float, value: int, stream) -> None:
    """Launch on ``stream`` (a cupy stream) a kernel that spins ~``seconds`` then fills ``value``."""
    import cupy

    global _kernel
    if _kernel is None:
        _kernel = cupy.RawKernel(SPIN_SRC, "spin_fill")
    clock_khz = cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrClockRate, 0)
    cycles = int(seconds * clock_khz * 1000)
    with stream:
        _kernel((264,), (256,), (np.uint64(ptr), np.uint64(n), np.int64(cycles), np.uint8(value)))


def pattern(xp, n: int, seed: int):
    """A byte pattern that differs with ``seed`` and along the buffer (xp: numpy, cupy or torch)."""
    if xp.__name__ == "torch":
        idx = xp.arange(n, dtype=xp.int64, device="cuda")
        return (((idx * 2654435761 + seed * 40503) >> 7) & 255).to(xp.uint8)
    idx = xp.arange(n, dtype=xp.uint64)
    return (((idx * xp.uint64(2654435761) + xp.uint64(seed * 40503)) >> xp.uint64(7)) & xp.uint64(255)).astype(xp.uint8)
