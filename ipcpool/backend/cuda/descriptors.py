"""IPC descriptors as bytes on the wire: pointer export data and event handles, 64 bytes each.

cuda.core 1.2 exports a buffer or an event only as a descriptor object and rebuilds one only
through its private constructors (``IPCBufferDescriptor._init``, ``IPCEventDescriptor._init``), and
gives the bytes out only through the descriptor's pickling (``__reduce__``). Every use of those is
here, so a cuda.core release that changes them breaks one module. Where cuda.bindings does the
same with no extra driver call, it is used instead (``export_pointer``).
"""

from __future__ import annotations

import ctypes
from typing import Any

from cuda.bindings import driver as cu
from cuda.core import Event

from ...protocol import HANDLE_BYTES
from .errors import check

try:  # private constructors: the only way to rebuild a descriptor from wire bytes in cuda.core 1.2
    from cuda.core._event import IPCEventDescriptor
    from cuda.core._memory._ipc import IPCBufferDescriptor
except ImportError:  # pragma: no cover - layout of other cuda.core versions
    from cuda.core._memory._ipc import IPCBufferDescriptor, IPCEventDescriptor  # type: ignore[no-redef]


def export_pointer(buf: Any) -> bytes:
    """The pointer export data of a pool allocation (a cuda.core Buffer). The one driver call
    ``Buffer.ipc_descriptor`` makes (cuMemPoolExportPointer), without the descriptor object."""
    data = check(cu.cuMemPoolExportPointer(cu.CUdeviceptr(int(buf.handle))), "cuMemPoolExportPointer")
    return ctypes.string_at(data.getPtr(), HANDLE_BYTES)


def buffer_descriptor(data: bytes, size: int) -> Any:
    """What ``Buffer.from_ipc_descriptor`` imports, from a pointer's export data. (The bindings
    route, cuMemPoolImportPointer and ``Buffer.from_handle``, would drop cuda.core's hold on the
    imported pool while the pointer lives, so the import stays with cuda.core.)"""
    return IPCBufferDescriptor._init(bytes(data), size)


def event_handle(event: Event) -> bytes:
    """The 64-byte IPC handle of a cuda.core IPC event. cuda.core fetched it (cuIpcGetEventHandle)
    when it made the event; asking the driver again would add a call to every record."""
    return bytes(event.ipc_descriptor.__reduce__()[1][0])


def event_descriptor(handle: bytes) -> Any:
    """What ``Event.from_ipc_descriptor`` opens, from a 64-byte IPC event handle."""
    return IPCEventDescriptor._init(bytes(handle), False)
