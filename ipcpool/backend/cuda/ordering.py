"""Ordering on the broker without blocking: a client's done event turned into a local marker (R2,
R4), the frees waiting on such markers, and the seals not yet seen complete."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any, Protocol

from .context import make_current
from .errors import is_cuda_error
from .events import open_ipc, record_marker, wait_for
from .session import CudaSession

log = logging.getLogger(__name__)


class Waiting(Protocol):
    """What the free queue reads of an allocation (``allocation.Allocation``)."""

    waits: list[DoneWait]


class Sealed(Protocol):
    """What the seal watch reads and sets of an allocation (``allocation.Allocation``)."""

    sealed: Any
    seal_done: bool
    freed: bool


class DoneWait:
    """A client's done event, bound when its message is read: the session's stream waits on it
    right away (a wait binds to the record it follows; the client may destroy or reuse the event
    once the broker has read the message, and a query of an opened event whose exporter destroyed
    it, or died, never reports completion: R4), and a local marker recorded after that wait is
    polled without blocking. The free itself runs on the backend's stream once the marker is done,
    or once the client's process is gone: a stream that waits on a dead process's event never moves
    on (seen on an H200: still blocked 15 s after the kill), and nothing queued behind it would."""

    __slots__ = ("keep", "marker", "session", "stream")

    def __init__(self, handle: bytes, session: CudaSession, device: int, keep: bool = False):
        self.session = session
        self.stream = None
        self.keep = False
        credit = session.credits.pop(handle, None)
        if credit is not None:
            # One of our events, recorded by the client: queried here, no wait enqueued. ``keep``:
            # readers wait on it too, so it lives on (in the allocation's events) after this.
            self.marker, self.keep = credit, keep
            return
        self.marker = None
        try:
            event = open_ipc(handle)
        except Exception as exc:
            if not is_cuda_error(exc):
                raise
            # The client keeps its done events alive until the broker has read them, so this
            # means it is gone (and its work with it).
            log.warning("cannot open a done event (%s): the client is gone; not waiting for it", exc)
            return
        try:
            if event.is_done:   # R1/R2: the host sees it complete, so nothing waits on it (~1 µs)
                return
            if session.closed:  # a late message: wait on a stream of its own, never a shared one (R3)
                self.stream = stream = make_current(device).create_stream()
            else:
                stream = session.stream(device)
            wait_for(stream, event)   # bound now, to the record the client made before its message (R4)
            self.marker = record_marker(stream)   # (the broker's current device may be another)
        finally:
            event.close()

    def settle(self) -> bool:
        """True (and the marker dropped) once nothing more needs waiting for. Never blocks."""
        if self.marker is not None and not (self.session.peer_dead or self.marker.is_done):
            return False
        if self.marker is not None:
            if not self.keep:
                self.marker.close()
            self.marker = None
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        return True


class DeferredFrees:
    """Frees waiting on their importers' done events (R2): each runs, through the callback it was
    queued with, once every wait of its allocation has settled."""

    def __init__(self) -> None:
        self._pending: list[tuple[Waiting, Callable[[Any], None], str]] = []

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, alloc: Waiting, free_now: Callable[[Any], None], owner: str) -> None:
        self._pending.append((alloc, free_now, owner))

    def run_ready(self) -> None:
        """Never blocks: run the frees whose importers are done. One that fails is logged and
        dropped (what it could not release stays until the broker exits): left queued, it would
        fail again at every sweep, and the frees behind it with it."""
        if self._pending:
            waiting = []
            for alloc, free_now, owner in self._pending:
                try:
                    alloc.waits = [w for w in alloc.waits if not w.settle()]
                    if alloc.waits:
                        waiting.append((alloc, free_now, owner))
                    else:
                        free_now(alloc)
                except Exception as exc:   # noqa: BLE001 (a driver failure: the others go on)
                    log.error("a free in pool %r failed and is dropped: %s", owner, exc)
            self._pending = waiting

    def owners(self) -> list[str]:
        """The pool of each free still waiting (for the warning at shutdown)."""
        return [owner for _, _, owner in self._pending]


class SealWatch:
    """Seals recorded but not yet seen complete, oldest first."""

    def __init__(self) -> None:
        self.unconfirmed: collections.deque[Sealed] = collections.deque()

    def watch(self, alloc: Sealed) -> None:
        self.unconfirmed.append(alloc)   # its completion is noted later, off any request

    def confirm(self, most: int = 64) -> None:
        """Note seal events that have completed (a few queries per call, oldest first), so a
        batch attach need not wait on, or even query, a thousand long-finished seals."""
        for _ in range(min(most, len(self.unconfirmed))):
            alloc = self.unconfirmed[0]
            if alloc.sealed is not None and not alloc.freed and not alloc.sealed.is_done:
                return   # seals complete in order on a stream; later ones likely pending too
            self.unconfirmed.popleft()
            alloc.seal_done = alloc.sealed is not None
