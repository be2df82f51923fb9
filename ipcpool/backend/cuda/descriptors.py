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


def event_handle(event: Event) -> bytes:
    """The 64-byte IPC handle of a cuda.core IPC event. cuda.core fetched it (cuIpcGetEventHandle)
    when it made the event; asking the driver again would add a call to every record."""
    return bytes(event.ipc_descriptor.__reduce__()[1][0])


# What ``Buffer.from_ipc_descriptor`` imports, from (pointer export data, size), and what
# ``Event.from_ipc_descriptor`` opens, from (an event's 64-byte handle, False): the constructors
# themselves, bound here once, so the import paths cost what they did. Both paths are the hand-off
# path, and the bindings route changes them: for a pointer, cuMemPoolImportPointer with
# ``Buffer.from_handle(ptr, size, mr)`` bypasses the handle cuda.core gives an imported pointer
# (it holds the imported pool until the pointer is freed; ``from_handle`` documents no such hold);
# for an event, cuIpcOpenEventHandle needs a handle struct built in Python on every open (~0.7 µs
# more, measured) and a wrapper in place of cuda.core's Event. Neither is done without a GPU to
# test it on.
buffer_descriptor = IPCBufferDescriptor._init
event_descriptor = IPCEventDescriptor._init
