"""CUDA failures as ipcpool errors: one map, used by every module of this backend.

Two kinds of failure reach us: a ``(CUresult, ...)`` tuple from cuda.bindings (``check`` looks the
code up) and the ``CUDAError`` that cuda.core raises, which carries no code, only a message that
names the error (``translate`` finds the name there). Both go through ``_CLASSES``; anything not in
it is the root ``IpcPoolError``. The message keeps the driver's name for the error. Code around
driver calls says what it was doing with ``cuda_errors`` and leaves the rest to this module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from cuda.bindings import driver as cu

from ...errors import BackendUnavailable, IpcPoolError, OutOfMemory

# Driver errors that mean something an ipcpool user can act on; every other failure is the root.
_CLASSES: dict[Any, type[IpcPoolError]] = {
    cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY: OutOfMemory,
}
# The same, by the part of the name cuda.core's messages carry ("OUT_OF_MEMORY").
_BY_NAME = {code.name.removeprefix("CUDA_ERROR_"): cls for code, cls in _CLASSES.items()}


def is_cuda_error(exc: BaseException) -> bool:
    """True when a driver call failed: the exception cuda.core raises, or the one ``check`` raises
    for a cuda.bindings result (it carries the driver's code as ``cuda_result``). Callers that
    act on a failed driver call (cleanup, a missing peer event) must see both alike.

    cuda.core (1.2) defines its exception as ``CUDAError`` in a private module and exports it from
    no public one, so it is recognised here, and only here, by its name and package instead of by
    importing it."""
    if getattr(exc, "cuda_result", None) is not None:
        return True
    cls = type(exc)
    return cls.__name__ == "CUDAError" and cls.__module__.startswith("cuda.core.")


def translate(exc: Exception, what: str) -> IpcPoolError:
    """A failed driver call (see ``is_cuda_error``) as an ipcpool error (raise it ``from exc``)."""
    text = str(exc)
    cls = next((c for name, c in _BY_NAME.items() if name in text), IpcPoolError)
    return cls(f"{what}: {text}")


class cuda_errors:  # noqa: N801 (a context manager, named like contextlib's)
    """A driver call that fails in the block is raised as an ipcpool error (``translate``, ``raise
    ... from``), the way httpcore's ``map_exceptions`` translates at the boundary::

        with cuda_errors("importing a slab of pool %r", name):
            ...

    Anything else passes unchanged. The message is ``what % args`` followed by the driver's, made
    only on a failure (these blocks sit on the hand-off's path, where even a format costs). ``error``
    raises that class instead of the one the driver's code maps to; ``undo`` runs first, to roll
    back what the block did before the failure."""

    __slots__ = ("_args", "_error", "_undo", "_what")

    def __init__(self, what: str, *args: Any, error: type[IpcPoolError] | None = None,
                 undo: Callable[[], None] | None = None) -> None:
        self._what, self._args, self._error, self._undo = what, args, error, undo

    def __enter__(self) -> None:
        return None

    def __exit__(self, cls: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        if not isinstance(exc, Exception) or not is_cuda_error(exc):
            return False   # no failure, or not the driver's: it passes unchanged
        if self._undo is not None:
            self._undo()
        what = self._what % self._args if self._args else self._what
        raise (translate(exc, what) if self._error is None else self._error(f"{what}: {exc}")) from exc


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
        exc = _CLASSES.get(err, IpcPoolError)(f"{what} failed: {error_name(err)}")
        exc.cuda_result = err   # a failed driver call (``is_cuda_error``), not a bug of ours
        raise exc
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return result[1:]
