"""GPU tests: real brokers on the CUDA backend, real client processes (spawn). Skipped cleanly
where there is no usable CUDA driver and device (CI)."""

from __future__ import annotations

import pytest

from ipcpool.backend import probe_cuda

CUDA_OK, CUDA_WHY = probe_cuda()


def pytest_collection_modifyitems(config, items):
    if CUDA_OK:
        return
    skip = pytest.mark.skip(reason=f"no usable CUDA GPU: {CUDA_WHY}")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture
def cuda_broker(start_broker):
    """A broker on the CUDA backend with its default pool."""
    return start_broker(backend="cuda")


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
