"""A client session on the broker: its streams (one per device, R3), the events it was handed,
and the credits it holds (events of ours its client may record instead of exporting its own)."""

from __future__ import annotations

from typing import Any, Protocol

from cuda.core import Stream

from ...errors import ClosedError, InvalidRequest
from ..base import SessionContext
from .context import make_current
from .events import CreditStock, Graveyard

MAX_CREDITS = 64   # events of ours a session may hold unused (see CudaSession.issue_credit)


class FreeSweeper(Protocol):
    """What a session needs of the broker backend."""

    def sweep(self) -> None:
        """Run the frees whose done events have completed; never blocks."""

    def keep_graveyard(self, graveyard: Graveyard) -> None:
        """Sweep ``graveyard`` from now on (a closed session's events still pending)."""

    credits: CreditStock   # the broker's recycled credits


class CudaSession(SessionContext):
    """One stream per device (allocations and ready events; R3), and the events retired on it."""

    def __init__(self, backend: FreeSweeper):
        self._backend = backend
        self._streams: dict[int, Stream] = {}
        self.graveyard = Graveyard()
        self._handed: list[tuple[Stream, Any]] = []
        # Events of ours the client may record instead of exporting its own (handle -> event): a
        # seal recorded on one is waited on by readers directly, one GPU hop from the writer.
        self.credits: dict[bytes, Any] = {}
        self.closed = False
        self.peer_dead = False

    def stream(self, device: int) -> Stream:
        if self.closed:
            raise ClosedError("session is closed")
        stream = self._streams.get(device)
        if stream is None:
            stream = make_current(device).create_stream()
            self._streams[device] = stream
        return stream

    def streams(self) -> list[Stream]:
        return list(self._streams.values())

    def issue_credit(self, device: int) -> bytes:
        """An IPC event of ours on ``device`` for the client to record, idle (recycled from the
        backend's stock once complete, ``CreditStock``): it stays ours (alive as long as anyone may
        wait on it, R4), queried locally."""
        if self.closed or len(self.credits) >= MAX_CREDITS:
            return b""
        event = self._backend.credits.take(device)   # never recorded here: no GPU work of ours per credit
        self.credits[event.ipc_handle] = event
        return event.ipc_handle

    def hand_out(self, stream: Stream, event: Any) -> None:
        """An event recorded on ``stream`` and named in a reply: alive until the client's next
        message (by then it has opened it and enqueued its wait), and until it has completed,
        then retired like any other (R4)."""
        self._handed.append((stream, event))

    def _retire_handed(self) -> None:
        # Buried on the stream it was recorded on: a marker there passes only after the event
        # (a marker on another device's stream may pass at once, the event still pending).
        for stream, event in self._handed:
            self.graveyard.bury(stream, event)
        self._handed = []

    def peer_progressed(self) -> None:
        # Sweep first: what this very reply handed out is buried after the sweep, so it is
        # dropped at a later message at the earliest, never before the client could open it.
        self.graveyard.sweep()
        self._retire_handed()
        self._backend.sweep()

    def peer_gone(self) -> None:
        """The client's process has exited, so its GPU work is over: its done events, which may now
        never complete, no longer hold frees back."""
        self.peer_dead = True
        self._backend.sweep()

    def close(self) -> None:
        if self.closed:
            return
        self._retire_handed()
        self.closed = True
        for event in self.credits.values():   # never used: back to the stock
            event.close()
        self.credits.clear()
        self.graveyard.sweep()
        if len(self.graveyard):
            # Hand what is still pending to the backend; it sweeps it later. Never block here.
            self._backend.keep_graveyard(self.graveyard)
        self.graveyard = Graveyard()
        # Destroying a stream with work queued is fine: the work completes, then it is released.
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()
        self._backend.sweep()


def as_session(session: SessionContext) -> CudaSession:
    if not isinstance(session, CudaSession):
        raise InvalidRequest(f"not a CUDA session: {type(session).__name__}")
    return session
