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
