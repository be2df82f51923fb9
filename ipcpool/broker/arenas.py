"""Arenas: a range of pool memory a session carves its named objects from itself.

A create in an arena needs no round trip: the client picks the offset, sends the create without
waiting, and writes at once (the range is idle on the device: a fresh arena is, and a range comes
back only after every importer's done event completed, R2). Here the broker keeps the same ranges
in a mirror allocator, refuses a range that is outside the arena, misaligned or taken, and tells
the client when a range is idle again (``{"notify": "reclaim"}``).

The arena's memory is held by the arena itself, not by its session: when the session goes, the
objects it sealed live on in it, and the arena is freed once the last of them has gone.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

from ..backend.allocator import RangeAllocator
from ..errors import InvalidRequest, IpcPoolError
from ..protocol import ARENA_ALIGN, MAX_ARENAS
from .registry import Allocation, Registry
from .session import Session

log = logging.getLogger(__name__)


class Arena:
    __slots__ = ("alloc", "closed", "ranges", "session")

    def __init__(self, alloc: Allocation, session: Session):
        self.alloc = alloc
        self.session = session
        self.ranges = RangeAllocator(alloc.size, ARENA_ALIGN)   # the client's carving, mirrored
        self.closed = False   # its session is gone: freed once its last range is idle

    @property
    def aid(self) -> int:
        return self.alloc.aid


class ArenaTable:
    def __init__(self, registry: Registry, notify: Callable[[Session, dict], None]):
        self.registry = registry
        self._notify = notify
        self.arenas: dict[int, Arena] = {}
        self._idle: collections.deque[tuple[Arena, int]] = collections.deque()

    def open(self, session: Session, pool_name: str, nbytes: int) -> Arena:
        pool = self.registry.pool(pool_name)
        limit = pool.arena_limit
        if not limit:
            raise InvalidRequest(f"pool {pool_name!r} hands out no arenas; create objects one by one")
        mine = sum(1 for a in self.arenas.values() if a.session is session and a.alloc.pool is pool)
        if mine >= MAX_ARENAS:
            raise InvalidRequest(f"this session has {mine} arenas in pool {pool_name!r}, the most it may")
        size = min(nbytes, limit) // ARENA_ALIGN * ARENA_ALIGN
        if size <= 0:
            raise InvalidRequest(f"an arena holds at least {ARENA_ALIGN} bytes")
        alloc = self.registry.allocate(session, size, pool_name)   # counted against the quota
        arena = Arena(alloc, session)
        self.registry.hold(alloc, arena)
        self.registry.free(session, alloc.aid)   # the arena holds it now, not the session
        self.arenas[alloc.aid] = arena
        return arena

    def carve(self, session: Session, aid: int, offset: int, nbytes: int) -> Allocation:
        """The range the client carved at ``offset`` of its arena ``aid``, held by ``session``."""
        arena = self.arenas.get(aid)
        if arena is None or arena.session is not session or arena.closed:
            raise InvalidRequest(f"arena {aid} is not one of this session's")
        try:
            arena.ranges.reserve(offset, nbytes)
        except IpcPoolError as exc:
            raise InvalidRequest(f"arena {aid}: {nbytes} bytes at offset {offset}: {exc}") from None
        try:
            return self.registry.carve(session, arena.alloc, offset, nbytes, lambda: self._idle.append((arena, offset)))
        except BaseException:
            arena.ranges.free(offset)
            raise

    def settle(self) -> None:
        """Hand idle ranges back (called by the server's loop, never from inside a backend sweep):
        to the client that carves the arena, or, once its session is gone and nothing is left in
        it, free the arena itself."""
        while self._idle:
            arena, offset = self._idle.popleft()
            arena.ranges.free(offset)
            if not arena.closed:
                self._notify(arena.session, {"notify": "reclaim", "arena": arena.aid, "offset": offset})
            elif not arena.ranges.used:
                self._release(arena)

    def stats(self) -> dict[str, dict[str, int]]:
        """Per pool: bytes held in arenas (counted as used), and how many of them hold nothing."""
        out: dict[str, dict[str, int]] = {}
        for arena in self.arenas.values():
            row = out.setdefault(arena.alloc.pool.spec.name, {"arena_bytes": 0, "arena_free": 0})
            row["arena_bytes"] += arena.alloc.size
            row["arena_free"] += arena.alloc.size - arena.ranges.used
        return out

    def end_session(self, session: Session) -> None:
        for arena in [a for a in self.arenas.values() if a.session is session]:
            arena.closed = True
            if not arena.ranges.used:
                self._release(arena)

    def _release(self, arena: Arena) -> None:
        del self.arenas[arena.aid]
        self.registry.unhold(arena.alloc, arena, b"", None)
        log.debug("arena %d released", arena.aid)
