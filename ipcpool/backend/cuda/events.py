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
from collections.abc import Callable
from typing import Any

from cuda.bindings.driver import (
    CUevent_flags,
    CUresult,
    cuEventCreate,
    cuEventDestroy,
    cuEventQuery,
    cuEventRecord,
    cuEventSynchronize,
    cuStreamWaitEvent,
)
from cuda.core import Event, EventOptions

from .context import OnDevice, OnStream
from .descriptors import event_handle, open_event
from .errors import check, is_cuda_error

_PLAIN = EventOptions()
_IPC = EventOptions(ipc_enabled=True)
_IPC_FLAGS = int(CUevent_flags.CU_EVENT_INTERPROCESS) | int(CUevent_flags.CU_EVENT_DISABLE_TIMING)


class DriverEvent:
    """An event held as a driver CUevent (``handle``): a peer's event, opened from its handle
    (cuda.core opens one only from a privately built descriptor), or a credit (``IpcEvent``).
    Offers what the backend uses of a cuda.core Event: ``is_done``, ``sync``, ``close``."""

    __slots__ = ("handle", "ptr")

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.ptr = int(handle)   # (the CUevent as an int, for a query in C: ``ClientPool.query_event``)

    @property
    def is_done(self) -> bool:
        (err,) = cuEventQuery(self.handle)
        if err == CUresult.CUDA_ERROR_NOT_READY:
            return False
        check((err,), "cuEventQuery")
        return True

    def sync(self) -> None:
        check(cuEventSynchronize(self.handle), "cuEventSynchronize")

    def close(self) -> None:
        if self.handle is not None:
            cuEventDestroy(self.handle)
            self.handle = None


class IpcEvent(DriverEvent):
    """An interprocess event of ours that is never recorded here, and its 64-byte handle
    (``ipc_handle``): a credit (see ``Ordering.credit``) is recorded by a peer, so that no command
    of ours, and with it no switch to our context on the GPU, is needed per credit. (cuda.core
    makes IPC events only by recording them; ``record_ipc`` makes the ones recorded here.)

    Credits come from a ``CreditStock`` and go back to it on ``close``: clients keep a credit open
    by its handle bytes (opening one costs ~10 µs, H100), which is safe only because no credit is
    destroyed while the broker lives, so its bytes never name another event."""

    __slots__ = ("device", "ipc_handle", "stock")

    def __init__(self, device: int, stock: CreditStock | None) -> None:
        super().__init__(check(cuEventCreate(_IPC_FLAGS), "cuEventCreate"))
        self.device = device
        self.stock = stock
        try:
            self.ipc_handle = event_handle(self.handle)
        except BaseException:
            self.destroy()
            raise

    def close(self) -> None:
        if self.stock is not None:
            self.stock.give_back(self)
        else:
            self.destroy()

    def destroy(self) -> None:
        DriverEvent.close(self)


class CreditStock:
    """The broker's credits, recycled (see ``IpcEvent``). One goes back to the free list once it
    has completed: whoever records it next makes a new record that nobody still waits on, and a
    reader that queries it learns of that record only after the one it came for (the free that
    returns a seal's credit runs after every reader's done event, R2). One that never completes
    (its recorder died mid-record) is kept aside, never handed out and never destroyed."""

    def __init__(self) -> None:
        self._free: dict[int, list[IpcEvent]] = {}
        self._stuck: list[IpcEvent] = []
        self._out: set[int] = set()   # id() of the credits handed out (a second give-back is a bug)

    def take(self, device: int) -> IpcEvent:
        free = self._free.get(device)
        if free:
            event = free.pop()
        else:
            with OnDevice(device):
                event = IpcEvent(device, self)
        self._out.add(id(event))
        return event

    def give_back(self, event: IpcEvent) -> None:
        if id(event) not in self._out:
            return   # (already back: never on the free list twice)
        self._out.discard(id(event))
        try:
            done = event.is_done
        except Exception as exc:   # noqa: BLE001 (a driver failure: never hand it out again)
            if not is_cuda_error(exc):
                raise
            done = False
        (self._free.setdefault(event.device, []) if done else self._stuck).append(event)

    def close(self) -> None:
        """At shutdown: every credit destroyed (clients are gone with the broker)."""
        for event in [e for f in self._free.values() for e in f] + self._stuck:
            event.destroy()
        self._free.clear()
        self._stuck.clear()


def record_ipc(stream: Any) -> tuple[Any, bytes]:
    """Record a fresh IPC event on ``stream``; return it (a cuda.core Event) and its 64-byte handle.

    cuda.core makes and records the event (its public ``EventOptions(ipc_enabled=True)``); only the
    handle's bytes come from the driver call, which cuda.core gives out only through a private
    descriptor. This is the hot path of every seal, ready and done event: the driver-API route
    (cuEventCreate, cuIpcGetEventHandle, cuEventRecord, each through cuda.bindings, inside a
    context check) cost 9-13 µs a record on an H100, cuda.core's 2-4 µs. The event is made in the
    current context; where that is not the stream's (a peer device's stream, or no context
    current), cuEventRecord refuses it, and the record is made again in the stream's context."""
    event = _in_streams_context(stream, lambda: stream.record(options=_IPC))
    try:
        return event, event_handle(event.handle)
    except BaseException:
        event.close()
        raise


def record_marker(stream: Any) -> Any:
    """Record a plain event (ours alone, queried on the host) on ``stream``, in the stream's
    context where the current one is another device's (as ``record_ipc``)."""
    return _in_streams_context(stream, lambda: stream.record(options=_PLAIN))


def wait_for(stream: Any, event: Any) -> None:
    """Make ``stream`` (a cuda.core Stream) wait for the latest record of ``event`` (a
    ``DriverEvent`` or a cuda.core Event); the wait binds now (R4)."""
    if isinstance(event, DriverEvent):
        check(cuStreamWaitEvent(stream.handle, event.handle, 0), "cuStreamWaitEvent")
    else:
        stream.wait(event)


def record_into(stream: Any, handle: bytes) -> None:
    """Record a peer's IPC event on ``stream`` (it behaves as a local event once opened); close
    our import at once: a recorded event is released only after the record has completed. Opened
    in the current context, and again in the stream's where that refuses the record (a peer
    device's stream), as ``record_ipc`` makes its event: the context check costs more than the
    record on the usual path (a writer's seal, on its pool's device)."""
    _in_streams_context(stream, lambda: _open_and_record(stream, handle))


def _in_streams_context(stream: Any, record: Callable[[], Any]) -> Any:
    """``record()`` in the current context, and again in ``stream``'s where the driver refuses
    that (CUDA_ERROR_INVALID_HANDLE: a peer device's stream, or no context current)."""
    try:
        return record()
    except Exception as exc:
        if not is_cuda_error(exc):
            raise
        with OnStream(stream):
            return record()


def _open_and_record(stream: Any, handle: bytes) -> None:
    event = open_ipc(handle)
    try:
        check(cuEventRecord(event.handle, stream.handle), "cuEventRecord on a peer's event")
    finally:
        event.close()


def open_ipc(handle: bytes) -> DriverEvent:
    """A peer's IPC event, opened in the current context; close it once its wait is enqueued."""
    return DriverEvent(open_event(handle))


class Graveyard:
    """Objects to drop once ``stream`` has passed the point where they were buried (events that
    have completed by then go at once)."""

    def __init__(self) -> None:
        self._graves: collections.deque[tuple[Event, tuple]] = collections.deque()

    def bury(self, stream: Any, *objects: Any) -> None:
        if objects and all(_complete(obj) for obj in objects):
            # Nothing left for a marker to pass: dropped now (a query each). Every hand-off's range
            # retires its seal's credit this way as it goes idle, complete by then: a marker was a
            # record, then a sweep's query and a destroy, per hand-off for nothing.
            _close_all(objects)
            return
        self._graves.append((record_marker(stream), objects))

    def sweep(self) -> int:
        """Drop what is past; never blocks. Graves of one stream complete in order, so stop at the
        first one still pending (others behind it on other streams wait for the next sweep)."""
        n = 0
        while self._graves and self._graves[0][0].is_done:
            marker, objects = self._graves.popleft()
            marker.close()
            _close_all(objects)
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
            _close_all(objects)


def _complete(obj: Any) -> bool:
    """Whether ``obj`` is an event whose work has completed (a query: no command of ours)."""
    if getattr(type(obj), "is_done", None) is None:
        return False
    try:
        return bool(obj.is_done)
    except Exception as exc:   # noqa: BLE001 (a driver failure: the marker decides, as before)
        if not is_cuda_error(exc):
            raise
        return False


def _close_all(objects: tuple) -> None:
    for obj in objects:
        close = getattr(obj, "close", None)
        if close is not None:
            close()
