"""IPC exports as bytes on the wire: pointer export data and event handles, 64 bytes each.

cuda.core 1.2 turns these into descriptor objects and back only through private constructors
and pickling, while the wire carries plain bytes. So this module makes the same driver calls
cuda.core makes (cuMemPoolExportPointer/ImportPointer, cuIpcGetEventHandle/OpenEventHandle)
through cuda.bindings, whose API is public, and hands the imported pointer back to cuda.core as a
``Buffer`` of its memory resource (``Buffer.from_handle``), which frees it as cuda.core's own
import would: ``mr.deallocate``, a cuMemFreeAsync on the stream given.
"""

from __future__ import annotations

import ctypes
from typing import Any

from cuda.bindings import driver as cu
from cuda.core import Buffer

from ...errors import InvalidRequest
from ...sizes import HANDLE_BYTES
from .errors import check


def _struct(kind: Any, data: bytes, what: str) -> Any:
    """A 64-byte driver struct holding ``data`` (the bindings give it no bytes setter)."""
    if len(data) != HANDLE_BYTES:
        raise InvalidRequest(f"{what} is {HANDLE_BYTES} bytes, got {len(data)}")
    out = kind()
    ctypes.memmove(out.getPtr(), bytes(data), HANDLE_BYTES)
    return out


def _bytes(struct: Any) -> bytes:
    """The 64 bytes of a driver struct (export data, an event handle), as the wire carries them."""
    return ctypes.string_at(struct.getPtr(), HANDLE_BYTES)


def export_pointer(buf: Any) -> bytes:
    """The pointer export data of a pool allocation (a cuda.core Buffer): the one driver call
    ``Buffer.ipc_descriptor`` makes, without the descriptor object."""
    return _bytes(check(cu.cuMemPoolExportPointer(cu.CUdeviceptr(int(buf.handle))), "cuMemPoolExportPointer"))


def import_pointer(mr: Any, data: bytes, size: int) -> Buffer:
    """A peer's pool allocation in ``mr`` (the imported pool), as ``Buffer.from_ipc_descriptor``
    imports it. Close the Buffer with the stream to free the import on (``close(stream=...)``):
    every release here does; one that is only collected is freed on the default stream."""
    export = _struct(cu.CUmemPoolPtrExportData, data, "pointer export data")
    ptr = check(cu.cuMemPoolImportPointer(mr.handle, export), "cuMemPoolImportPointer")
    return Buffer.from_handle(int(ptr), size, mr=mr)


def event_handle(event: Any) -> bytes:
    """The 64-byte IPC handle of an interprocess event (a driver CUevent)."""
    return _bytes(check(cu.cuIpcGetEventHandle(event), "cuIpcGetEventHandle"))


def open_event(handle: bytes) -> Any:
    """A peer's interprocess event, opened in the current context (a driver CUevent)."""
    return check(cu.cuIpcOpenEventHandle(_struct(cu.CUipcEventHandle, handle, "an IPC event handle")),
                 "cuIpcOpenEventHandle")
