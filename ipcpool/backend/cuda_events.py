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
from typing import Any

from cuda.bindings.driver import cuEventRecord
from cuda.core import Event, EventOptions

from ..errors import InvalidRequest
from .cuda_driver import check
from ..protocol import HANDLE_BYTES

try:  # private constructors: the only way to rebuild a descriptor from wire bytes in cuda.core 1.2
    from cuda.core._event import IPCEventDescriptor
except ImportError:  # pragma: no cover - layout of other cuda.core versions
    from cuda.core._memory._ipc import IPCEventDescriptor  # type: ignore[no-redef]

_IPC = EventOptions(ipc_enabled=True)
_PLAIN = EventOptions()


def record_ipc(stream: Any) -> tuple[Event, bytes]:
    """Record a fresh IPC event on ``stream``; return it and its 64-byte handle."""
    event = stream.record(options=_IPC)
    reserved = event.ipc_descriptor.__reduce__()[1][0]
    return event, bytes(reserved)


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
    return Event.from_ipc_descriptor(IPCEventDescriptor._init(bytes(handle), False))


def wait_ipc(stream: Any, handle: bytes) -> None:
    """Make ``stream`` wait on a peer's event (bound now, to its latest record); close our handle."""
    event = open_ipc(handle)
    try:
        stream.wait(event)
    finally:
        event.close()


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
