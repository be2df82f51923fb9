"""What the GPU tests share: the two-GPU marker, and client processes that attach or hand off
torch tensors (torch is imported in the child, so importing this needs no GPU)."""

from __future__ import annotations

import pytest

import ipcpool


def device_count() -> int:
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    if lib.cuInit(0) != 0:
        return 0
    n = ctypes.c_int(0)
    return n.value if lib.cuDeviceGetCount(ctypes.byref(n)) == 0 else 0


def two_gpus(test):
    """Marks a test that needs two GPUs: selected by ``-m two_gpus``, skipped with fewer."""
    return pytest.mark.two_gpus(pytest.mark.skipif(device_count() < 2, reason="needs two GPUs")(test))


def attach_all(socket_dir, names, out):
    import torch

    stream = torch.cuda.Stream()
    with ipcpool.connect(socket_dir) as c:
        leases = c.get_many(names, stream=stream)
        with torch.cuda.stream(stream):
            sums = [int(torch.from_dlpack(b).view(torch.uint8).sum(dtype=torch.int64)) for b in leases]
        for b in leases:
            b.release(stream=stream)
    out.put(sums)


def tensor_reader(socket_dir, count, out):
    import torch

    stream = torch.cuda.Stream()
    torch.cuda.set_stream(stream)
    seen = []
    with ipcpool.connect(socket_dir) as c:
        for i in range(count):
            lease = c.get(f"t/{i}", stream=stream, timeout=60)
            t = lease.tensor()
            seen.append((str(t.dtype), tuple(t.shape), t.data_ptr() == lease.ptr, float(t[1, 2].item())))
            lease.release(stream=stream)
    out.put(("seen", seen))


def tensor_writer(socket_dir, count, out):
    import torch

    stream = torch.cuda.Stream()
    torch.cuda.set_stream(stream)
    carved = 0
    with ipcpool.connect(socket_dir) as c:
        for i in range(count):
            buf = c.create(f"t/{i}", 64 * 128 * 2, meta={"dtype": "bfloat16", "shape": [64, 128]})
            carved += buf.carved_at is not None
            t = buf.tensor()
            t.fill_(i).mul_(2)   # several kernels; the seal follows them all on this stream
            buf.seal(stream=stream)
        stream.synchronize()
    out.put(("carved", carved))
