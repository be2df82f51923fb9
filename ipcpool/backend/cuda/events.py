"""IPC events: a fresh one per record, kept alive until nobody can still need it (rule R4).

cuda.core refuses to re-record an IPC event, and re-recording one that a peer may not yet have
waited on would make the peer wait for later, unrelated work. A fresh event costs ~4 µs to create
and ~1 µs to open, so every record here gets its own event, and no peer caches opened events by
handle bytes (the driver may hand the bytes of a destroyed event to a new one).

Lifetimes:
- the exporter's event must live until every importer has opened it *and* its waits have run:
  ``Graveyard`` keeps retired events until a marker recorded after the work that waited on them
  completes (checked without blocking);
- an opened peer event is closed right after its wait is enqueued (a wait binds at enqueue time).
"""

from __future__ import annotations

import collections
import ctypes
from typing import Any

from cuda.bindings.driver import (
    CUevent_flags,
    CUresult,
    cuEventCreate,
    cuEventDestroy,
    cuEventQuery,
    cuEventRecord,
    cuIpcGetEventHandle,
    cuStreamWaitEvent,
)
from cuda.core import Event, EventOptions

from ...errors import InvalidRequest
from ...protocol import HANDLE_BYTES
from .descriptors import event_descriptor, event_handle
from .errors import check

_IPC = EventOptions(ipc_enabled=True)
_PLAIN = EventOptions()


def record_ipc(stream: Any) -> tuple[Event, bytes]:
    """Record a fresh IPC event on ``stream``; return it and its 64-byte handle."""
    event = stream.record(options=_IPC)
    return event, event_handle(event)


class UnrecordedEvent:
    """An IPC event made with the driver API, never recorded here: a peer records it (a credit,
    see ``BrokerPool.credit``). cuda.core makes IPC events only by recording them, which would
    put a command of ours on the GPU, and with it a switch to our context there, for each one.
    Offers what the broker uses of a cuda.core Event: ``is_done``, ``close``, and ``wait_on``."""

    __slots__ = ("_event", "ipc_handle")

    def __init__(self) -> None:
        flags = int(CUevent_flags.CU_EVENT_INTERPROCESS) | int(CUevent_flags.CU_EVENT_DISABLE_TIMING)
        self._event = check(cuEventCreate(flags), "cuEventCreate")
        try:
            handle = check(cuIpcGetEventHandle(self._event), "cuIpcGetEventHandle")
            self.ipc_handle = ctypes.string_at(handle.getPtr(), HANDLE_BYTES)
        except BaseException:
            cuEventDestroy(self._event)
            raise

    @property
    def is_done(self) -> bool:
        (err,) = cuEventQuery(self._event)
        if err == CUresult.CUDA_ERROR_NOT_READY:
            return False
        check((err,), "cuEventQuery")
        return True

    def wait_on(self, stream: Any) -> None:
        """Make ``stream`` (a cuda.core Stream) wait for the latest record of this event."""
        check(cuStreamWaitEvent(stream.handle, self._event, 0), "cuStreamWaitEvent")

    def close(self) -> None:
        if self._event is not None:
            cuEventDestroy(self._event)
            self._event = None


def wait_for(stream: Any, event: Any) -> None:
    """``stream.wait(event)`` for a cuda.core Event or an ``UnrecordedEvent`` alike."""
    if isinstance(event, UnrecordedEvent):
        event.wait_on(stream)
    else:
        stream.wait(event)


def record_into(stream: Any, handle: bytes) -> None:
    """Record a peer's IPC event on ``stream`` (it behaves as a local event once opened); close
    our import at once: a recorded event is released only after the record has completed."""
    event = open_ipc(handle)
    try:
        check(cuEventRecord(event.handle, stream.handle), "cuEventRecord on a peer's event")
    finally:
        event.close()


def open_ipc(handle: bytes) -> Event:
    if len(handle) != HANDLE_BYTES:
        raise InvalidRequest(f"an IPC event handle is {HANDLE_BYTES} bytes, got {len(handle)}")
    return Event.from_ipc_descriptor(event_descriptor(bytes(handle), False))


class Graveyard:
    """Objects to drop once ``stream`` has passed the point where they were buried."""

    def __init__(self) -> None:
        self._graves: collections.deque[tuple[Event, tuple]] = collections.deque()

    def bury(self, stream: Any, *objects: Any) -> None:
        self._graves.append((stream.record(options=_PLAIN), objects))

    def sweep(self) -> int:
        """Drop what is past; never blocks. Graves of one stream complete in order, so stop at the
        first one still pending (others behind it on other streams wait for the next sweep)."""
        n = 0
        while self._graves and self._graves[0][0].is_done:
            marker, objects = self._graves.popleft()
            marker.close()
            for obj in objects:
                close = getattr(obj, "close", None)
                if close is not None:
                    close()
            n += 1
        return n

    def __len__(self) -> int:
        return len(self._graves)

    def drain(self) -> None:
        """Drop everything, waiting for each marker (used at close)."""
        while self._graves:
            marker, objects = self._graves.popleft()
            marker.sync()
            marker.close()
            for obj in objects:
                close = getattr(obj, "close", None)
                if close is not None:
                    close()
