"""The CUDA backend's one map from driver failures to ipcpool errors (no GPU needed)."""

import pytest

from ipcpool.errors import IpcPoolError, OutOfMemory

errors = pytest.importorskip("ipcpool.backend.cuda.errors", exc_type=ImportError)
cu = pytest.importorskip("cuda.bindings.driver")

# What cuda.core raises, as it looks from outside: a class named CUDAError in a cuda.core module.
CUDAError = type("CUDAError", (Exception,), {"__module__": "cuda.core._utils.cuda_utils"})


def test_a_bindings_result_is_classified_by_its_code():
    with pytest.raises(OutOfMemory, match="cuMemCreate failed"):
        errors.check((cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY,), "cuMemCreate")
    with pytest.raises(IpcPoolError) as info:
        errors.check((cu.CUresult.CUDA_ERROR_INVALID_VALUE,), "cuMemMap")
    assert type(info.value) is IpcPoolError
    assert errors.check((cu.CUresult.CUDA_SUCCESS, 7), "x") == 7


def test_a_cuda_core_error_is_classified_by_the_name_in_its_message():
    oom = CUDAError("CUDA_ERROR_OUT_OF_MEMORY: out of memory")
    assert errors.is_cuda_error(oom) and not errors.is_cuda_error(RuntimeError("x"))
    got = errors.translate(oom, "pool 'p' cannot allocate 8 bytes")
    assert type(got) is OutOfMemory and str(got) == "pool 'p' cannot allocate 8 bytes: " + str(oom)
    assert type(errors.translate(CUDAError("CUDA_ERROR_INVALID_VALUE: bad"), "x")) is IpcPoolError


def test_a_failed_bindings_call_counts_as_a_cuda_error_like_cuda_cores():
    # Callers clean up, or note a peer gone, on a failed driver call whichever route made it.
    with pytest.raises(OutOfMemory) as oom:
        errors.check((cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY,), "cuMemPoolImportPointer")
    with pytest.raises(IpcPoolError) as bad:
        errors.check((cu.CUresult.CUDA_ERROR_INVALID_VALUE,), "cuIpcOpenEventHandle")
    assert errors.is_cuda_error(oom.value) and errors.is_cuda_error(bad.value)
    assert not errors.is_cuda_error(IpcPoolError("ours")) and not errors.is_cuda_error(OutOfMemory("ours"))
    got = errors.translate(oom.value, "importing 8 bytes from pool 'p'")
    assert type(got) is OutOfMemory and "cuMemPoolImportPointer failed" in str(got)
