"""Ordering on the broker without blocking: a pool's ordering hooks (``CudaOrdering``, the CUDA side
of the ordering seam), a client's done event turned into a local marker (R2, R4), the frees
waiting on such markers, and the seals not yet seen complete."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any, Protocol

from cuda.core import Stream

from ...errors import InvalidRequest
from ..base import Export, SessionContext
from ..ordering import Ordering
from .allocation import as_alloc
from .context import make_current
from .errors import is_cuda_error
from .events import open_ipc, record_ipc, record_marker, wait_for
from .session import CudaSession, as_session

log = logging.getLogger(__name__)


class Waiting(Protocol):
    """What the free queue reads of an allocation (``allocation.Allocation``)."""

    waits: list[DoneWait]


class Sealed(Protocol):
    """What the seal watch reads and sets of an allocation (``allocation.Allocation``)."""

    sealed: Any
    seal_done: bool
    freed: bool


class OrderingServices(Protocol):
    """What a pool's ordering needs of the broker backend."""

    def sweep(self) -> None: ...

    def reaper(self, device: int) -> Stream:
        """The backend's own stream on ``device`` (frees run there; it never waits on a client)."""

    def retire(self, stream: Stream, *events: Any) -> None:
        """Close ``events`` once ``stream`` has passed this point (R4)."""

    def watch_seal(self, alloc: Any) -> None:
        """Note when the seal of ``alloc`` completes, off any request."""


class CudaOrdering(Ordering):
    """The ordering of one ``CudaPool``'s allocations (``allocation.Allocation`` handles) on
    ``device``: ready events for other sessions, seals, credits and the waits frees follow."""

    def __init__(self, backend: OrderingServices, device: int):
        self._backend = backend
        self.device = device

    def reexport(self, handle: object, export: Export, session: SessionContext) -> Export:
        """Another session opens this allocation: its stream follows the allocation (the first
        ready event, a local wait here), then a fresh ready event is recorded there for it."""
        alloc = as_alloc(handle)
        if alloc.freed:
            raise InvalidRequest("allocation was freed")
        if alloc.slab is not None or alloc.chunks is not None:
            return export   # idle on the GPU when handed out (a slab range; new VMM chunks)
        stream = as_session(session).stream(self.device)
        wait_for(stream, alloc.ready)
        event, ready_handle = record_ipc(stream)
        alloc.extra.append(event)  # alive until the free has run, like the first ready event
        return Export(size=export.size, offset=export.offset, data=export.data, ready_event=ready_handle)

    def add_release(self, handle: object, session: SessionContext, done_event: bytes) -> None:
        alloc = as_alloc(handle)
        if done_event:
            alloc.waits.append(DoneWait(done_event, as_session(session), self.device))  # now (R4)
        self._backend.sweep()

    def seal(self, handle: object, session: SessionContext, done_event: bytes) -> bytes:
        """The writer is done at ``done_event``: the free follows it, and readers get a broker event
        recorded once, after a wait on it on the writer's session stream (its own stream: R3)."""
        alloc = as_alloc(handle)
        sess = as_session(session)
        credit = sess.credits.get(done_event) if done_event else None
        if credit is not None and alloc.ready is None:
            # Recorded by the writer on one of our events: readers wait on that very event (one
            # GPU hop), and so does the free. Kept until the free has run, like any seal event.
            alloc.waits.append(DoneWait(done_event, sess, self.device, keep=True))
            alloc.extra.append(credit)
            alloc.sealed = credit
            self._backend.watch_seal(alloc)
            return done_event
        stream = sess.stream(self.device)
        if alloc.ready is not None:
            wait_for(stream, alloc.ready)
        if credit is not None:
            wait_for(stream, credit)   # our own event: a local wait (the DoneWait below only queries it)
        if done_event:
            alloc.waits.append(DoneWait(done_event, sess, self.device))  # the wait, on stream
        event, sealed = record_ipc(stream)
        alloc.extra.append(event)
        alloc.sealed = event
        self._backend.watch_seal(alloc)   # its completion is noted later, off any request
        return sealed

    def credit(self, session: SessionContext) -> bytes:
        return as_session(session).issue_credit(self.device)

    def check_promise(self, session: SessionContext, handle: bytes) -> None:
        if handle not in self.promises(session):
            raise InvalidRequest("create: seal_credit is not an unused credit of this session")

    def promises(self, session: SessionContext) -> dict[bytes, Any]:
        return as_session(session).credits

    def seal_done(self, handle: object) -> bool:
        alloc = as_alloc(handle)
        if not alloc.seal_done and alloc.sealed is not None and not alloc.freed and alloc.sealed.is_done:
            alloc.seal_done = True   # one query (~1 µs); then never again
        return alloc.seal_done or alloc.sealed is None

    def renew(self, handle: object) -> bool:
        """Idle once every done wait has settled (the queries a free makes, nothing enqueued: a
        wait on a reader's event, then a stream wait of the writer's on that, would tie the writer
        to a reader that may die, R3). The old seal and the events kept for it (no importer can
        open them now: none holds the memory) go once the reaper stream passes; the next seal then
        counts afresh. VMM memory is idle as soon as its last reader unmapped (after a sync)."""
        alloc = as_alloc(handle)
        if alloc.freed:
            return False
        alloc.waits = [w for w in alloc.waits if not w.settle()]
        if alloc.waits:
            return False
        if alloc.extra:
            self._backend.retire(self._backend.reaper(self.device), *alloc.extra)
        alloc.extra = []
        alloc.sealed, alloc.seal_done = None, False
        return True

    def join_seals(self, handles: list[object], session: SessionContext) -> bytes:
        sess = as_session(session)
        stream = sess.stream(self.device)
        waited = False
        for handle in handles:
            alloc = as_alloc(handle)
            if alloc.sealed is not None and not alloc.seal_done:
                if alloc.sealed.is_done:
                    alloc.seal_done = True      # never waited on again (a thousand-object attach)
                else:
                    wait_for(stream, alloc.sealed)   # our own events: a local wait, nothing to open
                    waited = True
        if not waited:   # every seal complete, as a single get answers: no event to open or keep alive
            return b""
        event, joined = record_ipc(stream)
        sess.hand_out(stream, event)
        return joined


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
