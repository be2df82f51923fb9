"""The CUDA backend's one map from driver failures to ipcpool errors (no GPU needed)."""

import pytest

from ipcpool.errors import BackendUnavailable, IpcPoolError, OutOfMemory

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


def test_cuda_errors_translates_a_driver_failure_in_its_block_and_nothing_else():
    oom = CUDAError("CUDA_ERROR_OUT_OF_MEMORY: out of memory")
    with pytest.raises(OutOfMemory) as got:
        with errors.cuda_errors("pool %r cannot allocate %s bytes", "p", 8):
            raise oom
    assert str(got.value) == str(errors.translate(oom, "pool 'p' cannot allocate 8 bytes"))
    assert got.value.__cause__ is oom
    with pytest.raises(OutOfMemory, match="^importing: cuMemCreate failed"):
        with errors.cuda_errors("importing"):
            errors.check((cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY,), "cuMemCreate")
    ours = IpcPoolError("ours")
    with pytest.raises(IpcPoolError) as passed:
        with errors.cuda_errors("x %s", "never formatted"):
            raise ours
    assert passed.value is ours
    with errors.cuda_errors("%d"):   # no failure: the message is never made
        pass


def test_cuda_errors_can_name_another_class_and_undo_first():
    undone = []
    bad = CUDAError("CUDA_ERROR_INVALID_VALUE: bad")
    with pytest.raises(BackendUnavailable) as got:
        with errors.cuda_errors("cannot import pool %r", "p", error=BackendUnavailable, undo=lambda: undone.append(1)):
            raise bad
    assert str(got.value) == f"cannot import pool 'p': {bad}" and undone == [1]
    with pytest.raises(KeyError):
        with errors.cuda_errors("x", undo=lambda: undone.append(2)):
            raise KeyError("not the driver's")
    assert undone == [1]
