"""File bytes to the GPU through pinned host buffers: reads and copies overlap.

A few pinned buffers (slots) form a ring. Reader threads fill the next slots from the file while
the copy engine moves the filled ones to the device on the caller's stream (cuMemcpyHtoDAsync from
pinned memory runs at the PCIe rate and returns at once); a slot is refilled only after the event
recorded behind its last copy has completed. The host never waits for the GPU except for a free
slot, and the loaded bytes are ordered on the stream like any other work of the caller.

The ring is made once per device and kept (pinning memory costs milliseconds); ``close`` waits for
the copies still reading from it before freeing it.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from cuda.bindings import driver as cu

from ..filecopy import read_exact
from . import driver as drv
from .context import OnDevice
from .errors import check

SLOTS = 4
SLOT_BYTES = 16 << 20
READERS = 3


class _Slot:
    __slots__ = ("ptr", "view", "event", "used")

    def __init__(self, size: int):
        self.ptr = int(check(cu.cuMemHostAlloc(size, 0), "cuMemHostAlloc"))
        self.view = memoryview((ctypes.c_ubyte * size).from_address(self.ptr)).cast("B")
        self.event = check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        self.used = False

    def wait(self) -> None:
        """The copy that last read this slot has finished (releases the GIL while it waits)."""
        if self.used:
            check(cu.cuEventSynchronize(self.event), "cuEventSynchronize")

    def close(self) -> None:
        self.wait()
        self.view.release()
        check(cu.cuEventDestroy(self.event), "cuEventDestroy")
        check(cu.cuMemFreeHost(self.ptr), "cuMemFreeHost")


class PinnedStager:
    """One device's ring of pinned slots and its reader threads."""

    def __init__(self, device: int, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES, readers: int = READERS):
        self.device, self.slot_bytes = device, slot_bytes
        self._lock = threading.Lock()   # one load at a time uses the ring
        with OnDevice(device):
            self._ctx = drv.current_context()
            self._slots: list[_Slot] = []
            try:
                for _ in range(slots):
                    self._slots.append(_Slot(slot_bytes))
            except BaseException:
                for s in self._slots:
                    s.close()
                raise
        self._pool = ThreadPoolExecutor(readers, thread_name_prefix="ipcpool-stage",
                                        initializer=lambda: check(cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent"))

    def _fill(self, slot: _Slot, fd: int, offset: int, n: int) -> None:
        slot.wait()
        read_exact(fd, slot.view[:n], offset)

    def run(self, pieces: list[tuple[int, int, int, int]], stream_handle: int,
            on_bytes: Callable[[int], None] | None) -> None:
        """Copy each ``(fd, file_offset, device_ptr, nbytes)`` to the device on the stream."""
        cut = [(fd, off + at, dst + at, min(self.slot_bytes, n - at))
               for fd, off, dst, n in pieces for at in range(0, n, self.slot_bytes)]
        slots, stream = self._slots, cu.CUstream(stream_handle)
        with self._lock, OnDevice(self.device):
            futures: dict[int, Future] = {}

            def submit(i: int) -> None:
                if i < len(cut):
                    fd, off, _, n = cut[i]
                    futures[i] = self._pool.submit(self._fill, slots[i % len(slots)], fd, off, n)

            for i in range(len(slots)):
                submit(i)
            try:
                for i, (_, _, dst, n) in enumerate(cut):
                    futures.pop(i).result()
                    slot = slots[i % len(slots)]
                    check(cu.cuMemcpyHtoDAsync(dst, slot.ptr, n, stream), "cuMemcpyHtoDAsync")
                    check(cu.cuEventRecord(slot.event, stream), "cuEventRecord")
                    slot.used = True
                    submit(i + len(slots))
                    if on_bytes is not None:
                        on_bytes(n)
            finally:
                for f in futures.values():   # (after a failure: no read may outlive the load)
                    f.cancel()
                    if not f.cancelled():
                        f.exception()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with OnDevice(self.device):
            for s in self._slots:
                s.close()
        self._slots = []
