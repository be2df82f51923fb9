"""CUDA failures as ipcpool errors: one map, used by every module of this backend.

Two kinds of failure reach us: a ``(CUresult, ...)`` tuple from cuda.bindings (``check`` reads the
code) and the ``CUDAError`` that cuda.core raises, whose message starts with the error's name
(``translate`` reads the name there). Both go through ``_CLASSES``; anything not in it is the root
``IpcPoolError``. The message keeps the driver's name for the error, so nothing is lost.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from cuda.bindings import driver as cu

from ...errors import BackendUnavailable, IpcPoolError, OutOfMemory

# Driver error names (without the CUDA_ERROR_ prefix) that mean something an ipcpool user can act
# on; every other failure is the root class.
_CLASSES: dict[str, type[IpcPoolError]] = {
    "OUT_OF_MEMORY": OutOfMemory,
}


def is_cuda_error(exc: BaseException) -> bool:
    """True for the exception cuda.core raises when a driver call fails. cuda.core (1.2) defines
    it as ``CUDAError`` in a private module and exports it from no public one, so it is recognised
    here, and only here, by its name and package instead of by importing it."""
    cls = type(exc)
    return cls.__name__ == "CUDAError" and cls.__module__.startswith("cuda.")


def _class_for(text: str) -> type[IpcPoolError]:
    for name, cls in _CLASSES.items():
        if name in text:
            return cls
    return IpcPoolError


def translate(exc: Exception, what: str) -> IpcPoolError:
    """A cuda.core ``CUDAError`` as an ipcpool error (raise it ``from exc``)."""
    text = str(exc)
    return _class_for(text)(f"{what}: {text}")


@contextmanager
def usable() -> Iterator[None]:
    """Setting a device current failed: CUDA cannot be used here at all."""
    try:
        yield
    except Exception as exc:
        if not (is_cuda_error(exc) or isinstance(exc, (RuntimeError, OSError))):
            raise
        raise BackendUnavailable(f"CUDA is not usable here: {exc}") from exc


def error_name(err: Any) -> str:
    try:
        res, name = cu.cuGetErrorName(err)
        if res == cu.CUresult.CUDA_SUCCESS:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # naming an error must never hide the error itself
        pass
    return str(err)


def check(result: tuple, what: str) -> Any:
    """Unpack a cuda.bindings ``(CUresult, *values)`` tuple, raising an ipcpool error on failure."""
    err = result[0]
    if err != cu.CUresult.CUDA_SUCCESS:
        name = error_name(err)
        raise _class_for(name)(f"{what} failed: {name}")
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return result[1:]
