"""The broker's side of a hand-off: arenas it mirrors and checks, and the seal boards.

A create in an arena needs no round trip: the client picks the offset, sends the create without
waiting, and writes at once (the range is idle on the device: a fresh arena is, and a range comes
back only after every importer's done event completed, R2). Here the broker keeps the same ranges
in a mirror allocator, refuses a range that is outside the arena, misaligned or taken, and tells
the client when a range is idle again (``{"notify": "reclaim"}``).

Each arena also gets a block of its pool's seal board (``ipcpool.shm.sealboard``), where its client posts
each seal; a reader the broker answered as *pending* watches that word instead of waiting for a
message. The broker checks every word a create names against the arena's block.

The arena's memory is held by the arena itself, not by its session: the objects a session sealed
live on after it. When the session goes, the arena gives back every part no object uses, and the
rest goes object by object as each is freed.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Container
from typing import Any, NamedTuple

from ..ranges import TakenRanges
from ..errors import InvalidRequest, IpcPoolError
from ..protocol import ARENA_ALIGN, MAX_ARENAS
from ..shm import sealboard
from ..replies import ReclaimNotice
from .registry import Allocation, Registry
from .session import Session

log = logging.getLogger(__name__)


class Arena:
    __slots__ = ("alloc", "carved", "closed", "first_seq", "ranges", "session", "top_seq", "words")

    def __init__(self, alloc: Allocation, session: Session, block: tuple[int, int] | None):
        self.alloc = alloc
        self.session = session
        self.ranges = TakenRanges(alloc.size, ARENA_ALIGN)   # the client's carving, mirrored
        self.closed = False   # its session is gone: shrunk to its objects, freed with the last
        # Its block on the pool's seal board (its first word), or None; the numbers it may give
        # its objects start at ``first_seq`` (``sealboard.Blocks``); the highest given so far.
        self.words, self.first_seq = block if block is not None else (None, 1)
        self.top_seq = 0
        self.carved: dict[int, int] = {}   # offset -> the allocation carved there, until idle

    @property
    def aid(self) -> int:
        return self.alloc.aid


class Ticket(NamedTuple):
    """What an arena's usual creates are checked against in C (``_native.usual_create``, which
    reads these fields by their place: a change here is a change there): made after the arena's
    first create is entered the Python way, dropped with its board block. The mirror's lists, the
    session's credits and the directory's map are the live ones, shared."""
    arena: Arena
    session: Session
    pool: str
    words: int                      # its first board word
    first_seq: int
    starts: list[int]               # the mirror's taken ranges (``TakenRanges.shared``)
    sizes: dict[int, int]
    capacity: int
    alignment: int
    map: Any                        # the pool's directory: its map, entries, probe length
    dir_capacity: int
    probes: int
    promises: Container[bytes] | None   # what a create may promise (``Ordering.promises``)
    limit: int                      # the uid's objects quota (0: none)
    uid: int


class Handoffs:
    def __init__(self, registry: Registry, notify: Callable[[Session, dict], None]):
        self.registry = registry
        self._notify = notify
        self.arenas: dict[int, Arena] = {}
        self.tickets: dict[int, Ticket] = {}   # arena id -> its ticket (``Ticket``)
        self._boards: dict[str, sealboard.Blocks] = {}   # pool name -> its board, shared out
        self._idle: collections.deque[tuple[Arena, int]] = collections.deque()

    def board(self, pool_name: str) -> sealboard.Board:
        """The seal board of ``pool_name`` (made when a client first imports the pool)."""
        blocks = self._boards.get(pool_name)
        if blocks is None:
            blocks = self._boards[pool_name] = sealboard.Blocks(sealboard.Board.create(pool_name))
        return blocks.board

    def open(self, session: Session, pool_name: str, nbytes: int) -> Arena:
        pool = self.registry.pool(pool_name)
        limit = pool.arenas.arena_limit
        if not limit:
            raise InvalidRequest(f"pool {pool_name!r} hands out no arenas; create objects one by one")
        mine = sum(1 for a in self.arenas.values() if a.session is session and a.alloc.pool is pool)
        if mine >= MAX_ARENAS:
            raise InvalidRequest(f"this session has {mine} arenas in pool {pool_name!r}, the most it may")
        size = min(nbytes, limit) // ARENA_ALIGN * ARENA_ALIGN
        if size <= 0:
            raise InvalidRequest(f"an arena holds at least {ARENA_ALIGN} bytes")
        alloc = self.registry.allocate(session, size, pool_name)   # counted against the quota
        self.board(pool_name)
        arena = Arena(alloc, session, self._boards[pool_name].take())
        self.registry.hold(alloc, arena)
        self.registry.free(session, alloc.aid)   # the arena holds it now, not the session
        self.arenas[alloc.aid] = arena
        return arena

    def carve(self, session: Session, aid: int, offset: int, nbytes: int) -> Allocation:
        """The range the client carved at ``offset`` of its arena ``aid``, held by ``session``."""
        arena = self.own(session, aid)
        self.reserve(arena, offset, nbytes)
        return self.record(session, arena, offset, nbytes)

    def reserve(self, arena: Arena, offset: int, nbytes: int) -> None:
        """The range at ``offset`` of ``arena`` (``own``), checked and taken in the mirror: all a
        create's directory entry needs (the rest, ``record``, may follow it)."""
        try:
            arena.ranges.reserve(offset, nbytes)
        except IpcPoolError as exc:
            raise InvalidRequest(f"arena {arena.aid}: {nbytes} bytes at offset {offset}: {exc}") from None

    def reserved(self, arena: Arena, size: int) -> None:
        """A range of ``size`` (rounded) taken in ``arena``'s mirror in C (``Ticket``): counted."""
        arena.ranges.took(size)

    def ticket(self, arena: Arena, session: Session, directory: Any, limit: int) -> None:
        """``arena``'s ticket, where it has none, for the C check of its next creates: ``directory``
        (its pool's, ``shm.directory.Directory``) and ``limit`` (the session's objects quota) as now."""
        if arena.aid in self.tickets or arena.words is None or arena.closed or directory is None:
            return
        starts, sizes = arena.ranges.shared()
        self.tickets[arena.aid] = Ticket(
            arena, session, arena.alloc.pool.spec.name, arena.words, arena.first_seq, starts, sizes,
            arena.ranges.capacity, arena.ranges.alignment, directory.mapping, directory.capacity, directory.probes,
            arena.alloc.pool.ordering.promises(session.backend), limit, session.cred.uid)

    def record(self, session: Session, arena: Arena, offset: int, nbytes: int) -> Allocation:
        """A reserved range as an allocation of its own, held by ``session``; the range goes back
        to the mirror where that fails."""
        try:
            alloc = self.registry.carve(session, arena.alloc, offset, nbytes, lambda: self._idle.append((arena, offset)))
        except BaseException:
            arena.ranges.free(offset)
            raise
        arena.carved[offset] = alloc.aid
        return alloc

    def carved(self, session: Session, aid: int, offset: int) -> int:
        """The allocation carved at ``offset`` of this session's arena ``aid``."""
        got = self.own(session, aid).carved.get(offset)
        if got is None:
            raise InvalidRequest(f"arena {aid} has nothing carved at offset {offset}")
        return got

    def word(self, arena: Arena, slot: int, seq: int) -> int:
        """The board word ``slot`` of ``arena``'s block (``own``) for an object numbered ``seq``, checked."""
        if arena.words is None or not 0 <= slot < sealboard.BLOCK:
            raise InvalidRequest(f"arena {arena.aid} has no seal-board word {slot}")
        if not arena.first_seq <= seq < sealboard.FIRST_MAX:
            raise InvalidRequest(f"create: seq {seq} is outside {arena.first_seq}..{sealboard.FIRST_MAX - 1}, "
                                 f"where arena {arena.aid}'s numbers go")
        if seq > arena.top_seq:
            arena.top_seq = seq
        return arena.words + slot

    def arena_alloc(self, session: Session, aid: int) -> Allocation | None:
        """The allocation of ``session``'s arena ``aid`` (the arena holds it, not the session);
        None where ``aid`` is not an open arena of ``session``."""
        arena = self.arenas.get(aid)
        return arena.alloc if arena is not None and arena.session is session and not arena.closed else None

    def own(self, session: Session, aid: int) -> Arena:
        """``session``'s open arena ``aid``, or the refusal naming it."""
        arena = self.arenas.get(aid)
        if arena is None or arena.session is not session or arena.closed:
            raise InvalidRequest(f"arena {aid} is not one of this session's")
        return arena

    def settle(self) -> None:
        """Hand idle ranges back (called by the server's loop, never from inside a backend sweep):
        to the client that carves the arena, or, once its session is gone, to the pool, and the
        arena itself with its last range."""
        while self._idle:
            arena, offset = self._idle.popleft()
            arena.ranges.free(offset)
            arena.carved.pop(offset, None)
            if not arena.closed:
                self._notify(arena.session, ReclaimNotice(arena.aid, offset).encode())
                continue
            arena.alloc.pool.arenas.free_part(arena.alloc.handle, offset)
            if not arena.ranges.used:
                self._retire(arena)

    def stats(self) -> dict[str, dict[str, int]]:
        """Per pool: bytes held in arenas (counted as used), and how many of them hold nothing."""
        out: dict[str, dict[str, int]] = {}
        for arena in self.arenas.values():
            row = out.setdefault(arena.alloc.pool.spec.name, {"arena_bytes": 0, "arena_free": 0})
            row["arena_bytes"] += arena.alloc.size
            row["arena_free"] += 0 if arena.closed else arena.alloc.size - arena.ranges.used
        return out

    def end_session(self, session: Session) -> None:
        """Its arenas carve no more: each gives back what no object uses (a short-lived writer of
        one small object keeps that object's bytes, not a whole arena)."""
        for arena in [a for a in self.arenas.values() if a.session is session]:
            arena.closed = True
            self._give_back_block(arena)
            if not arena.ranges.used:
                self._retire(arena)
                continue
            keep = [(off, arena.ranges.size_of(off)) for off in arena.ranges.offsets()]
            alloc = arena.alloc
            given = alloc.pool.arenas.shrink(alloc.handle, keep)
            if given:
                alloc.export = dataclasses.replace(alloc.export, size=alloc.export.size - given)
                if alloc.charged:
                    self.registry.bytes_by_uid[alloc.uid] -= given

    def _give_back_block(self, arena: Arena) -> None:
        self.tickets.pop(arena.aid, None)   # (its words go: no create is checked in C there again)
        if arena.words is not None:
            self._boards[arena.alloc.pool.spec.name].give_back(arena.words, arena.top_seq)
            arena.words = None

    def _retire(self, arena: Arena) -> None:
        """The arena carves no more and holds no range: its board block and its hold go."""
        del self.arenas[arena.aid]
        self._give_back_block(arena)
        self.registry.unhold(arena.alloc, arena, b"", None)
        log.debug("arena %d retired", arena.aid)

    def close(self) -> None:
        for blocks in self._boards.values():
            blocks.board.close()
        self._boards.clear()
