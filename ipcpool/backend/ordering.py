"""The ordering seam: how work on a pool's memory is ordered between processes (R1-R4), apart
from the memory itself (``base.BrokerPool``). The broker reaches it as ``pool.ordering``.

``Ordering`` is the concept, ``NullOrdering`` the implementation for memory with no asynchronous
work (the host, and CUDA pools restored read-only): every hook there is a no-op or an empty event.
The CUDA implementation (events, credits, done waits) is ``cuda.ordering.CudaOrdering``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container

from ..errors import InvalidRequest
from .records import Export, SessionContext

__all__ = ["NULL_ORDERING", "NullOrdering", "Ordering"]


class Ordering(ABC):
    """A pool's ordering hooks. ``handle`` is the pool's opaque allocation handle, ``session`` the
    ``SessionContext`` of the session whose stream orders the work."""

    @abstractmethod
    def reexport(self, handle: object, export: Export, session: SessionContext) -> Export:
        """The export for another session opening ``handle``: the cached data, with a ready event
        newly recorded on ``session``'s stream where the backend has events."""

    @abstractmethod
    def seal(self, handle: object, session: SessionContext, done_event: bytes) -> bytes:
        """The writer of a named object finished (its writes and the release of its import are
        done at ``done_event``). Order the eventual free after it, as ``add_release`` does, and
        return a handle of an event of the broker's own that completes after ``done_event``: readers
        wait on it. It is recorded once, never again, and lives until the handle is freed (R1, R4).
        Empty where the backend has no events."""

    @abstractmethod
    def credit(self, session: SessionContext) -> bytes:
        """The handle of an event of the broker's that ``session``'s client may record as its next
        done event on this pool's device (at a seal or a release), instead of exporting one of its
        own: the broker keeps it alive, queries it without enqueuing a wait, and readers of a seal
        wait on it directly. Empty where there are no events, or the session holds enough."""

    @abstractmethod
    def check_promise(self, session: SessionContext, handle: bytes) -> None:
        """A writer promises to record its seal on ``handle`` (a credit this session holds, unused)
        so that readers can be told of it before the seal; refuse anything else."""

    @abstractmethod
    def promises(self, session: SessionContext) -> Container[bytes] | None:
        """What ``check_promise`` takes: the handles ``session`` may promise (a live view: a
        membership test), or None where only an empty one (no events). For the broker's check of
        a create in C (``broker.arenas.Ticket``)."""

    @abstractmethod
    def seal_done(self, handle: object) -> bool:
        """True once the seal of named object ``handle`` has certainly completed (readers then need
        no event at all). Never blocks."""

    @abstractmethod
    def join_seals(self, handles: list[object], session: SessionContext) -> bytes:
        """One event on ``session``'s stream that completes after the seal of every one of
        ``handles`` (sealed objects of this pool): a batch of leases waits on it once, not once per
        object. Kept alive until the session's next message. Empty where there is nothing to wait on."""

    @abstractmethod
    def add_release(self, handle: object, session: SessionContext, done_event: bytes) -> None:
        """Another importer (a session that opened a shared allocation) released its import: order
        the eventual free after ``done_event``. The wait must be enqueued now, on ``session``'s
        stream, since the client may recycle the event once its message was read (R4)."""

    @abstractmethod
    def renew(self, handle: object) -> bool:
        """An allocation no one holds any more, kept (a checkpoint's spare) to be handed to a new
        writer instead of freed: True, and its seal forgotten, once it is idle (every importer's
        done event completed, as a free would wait for); False, with nothing changed that matters,
        while not. Never blocks and never waits on another session's event (R3)."""


class NullOrdering(Ordering):
    """No asynchronous work, so nothing to order: memory is idle whenever the broker looks."""

    def reexport(self, handle: object, export: Export, session: SessionContext) -> Export:
        return export

    def seal(self, handle: object, session: SessionContext, done_event: bytes) -> bytes:
        if done_event:
            self.add_release(handle, session, done_event)
        return b""

    def credit(self, session: SessionContext) -> bytes:
        return b""

    def check_promise(self, session: SessionContext, handle: bytes) -> None:
        if handle:   # no events: nothing to promise
            raise InvalidRequest("this pool has no events: a create names no seal_credit")

    def promises(self, session: SessionContext) -> None:
        return None

    def seal_done(self, handle: object) -> bool:
        return True

    def join_seals(self, handles: list[object], session: SessionContext) -> bytes:
        return b""

    def add_release(self, handle: object, session: SessionContext, done_event: bytes) -> None:
        pass

    def renew(self, handle: object) -> bool:
        return True


NULL_ORDERING = NullOrdering()   # stateless: one serves every pool
