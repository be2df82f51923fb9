"""Named growable buffers: who is attached, how big they are, and telling everyone when they grow.

A growable lives until it is deleted and every attached session has detached (a deleted one
accepts no new attachments). Its bytes count against its creator's quota, growth included. Each
grow bumps a generation; attached sessions other than the grower are told, and map the new
chunks before they next use the buffer (host: from the memfd they hold; CUDA: the new chunks' FDs
fetched over the control socket). Each buffer also has a word on the growth board
(``ipcpool.shm.growboard``), stamped at every grow before anyone is answered or told: a follower
on CUDA asks for the new chunks only once it sees the word change.

Each pool whose backend makes chunks at a cost (CUDA) keeps a stock of them (``backend.stock``,
``[growth] stock`` in the config): grows take from it first; it is refilled one chunk at a time
from the broker's idle pass, once no request came for 5 ms, and right after each answer to a create
or grow that took from it, with one chunk of at most QUICK_CHUNK (``refill_quick``): made while the
client maps its reply, it is there for the next step of a burst that starts small (a buffer
created at the granularity and doubled takes that size twice). Bigger chunks can take a
millisecond, which a request arriving meanwhile would wait: those wait for the quiet spell.
The stock counts against the pool's max_size, and yields to buffers: a grow may use the room it
holds, and the stock sheds what no longer fits. What it holds is lent to the sessions that grow
(``broker.loans``): their next grows take no chunk FD and no import. A reply that lent chunks, and
a grow that took its loan, refill nothing at once: the grower's next steps come from its loan, and
a chunk made beside them would only slow their driver calls down.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ..backend.base import BrokerGrowable
from ..backend.stock import ChunkStock
from ..errors import AllocationTooLarge, InvalidRequest, IpcPoolError, ObjectExists, ObjectNotFound, OutOfMemory
from ..replies import GrowableState
from ..shm.growboard import SLOTS, GrowthBoard
from ..sizes import round_up
from .loans import Loans
from .registry import Registry
from .session import Session

log = logging.getLogger(__name__)

MAX_CHUNKS = 1024   # per buffer: a reply lists them all, and a client maps each
MAX_GROWABLE = 1 << 48   # bytes of one buffer at most (256 TiB: above any device or host memory)
QUICK_CHUNK = 64 << 20   # refilled right after a grow's answer: tens of µs to make (H100)


@dataclass(eq=False)
class Growable:
    gid: int
    name: str
    pool: str
    uid: int
    memory: BrokerGrowable
    compression_requested: bool
    holders: collections.Counter = field(default_factory=collections.Counter)   # Session -> attaches
    gen: int = 0
    deleted: bool = False
    created: float = field(default_factory=time.time)
    stored: int = 0   # FDs already handed to the FD store
    word: int = -1    # on the growth board (-1: none, the board was full)
    stamp: int = 0    # what the broker last stored in that word

    def fields(self) -> GrowableState:
        """What a client needs to map it (besides the FDs)."""
        m = self.memory
        return GrowableState(self.name, m.size, list(m.chunks), self.gen, self.word, self.stamp, self.pool, m.info(),
                             self.compression_requested)

    def state(self, took: bool | None = None) -> GrowableState:
        """What a grow's reply says (the rest of ``fields`` the client has): size, chunks, and
        its word on the growth board with the stamp it holds; whether it ``took`` the loan."""
        m = self.memory
        return GrowableState(self.name, m.size, list(m.chunks), self.gen, self.word, self.stamp, took=took)

    def describe(self) -> dict:
        return {"name": self.name, "kind": "growable", "pool": self.pool, "size": self.memory.size,
                "chunks": len(self.memory.chunks), "attached": sum(self.holders.values()),
                "state": "deleting" if self.deleted else "live", "gen": self.gen}


class GrowableTable:
    def __init__(self, registry: Registry, board_slots: int = SLOTS):
        self.registry = registry
        self.board: GrowthBoard | None = None   # None: no board, every follower's sync asks
        if board_slots:
            try:
                self.board = GrowthBoard(board_slots)
            except OSError as exc:   # a kernel without F_SEAL_FUTURE_WRITE (Linux < 5.1)
                log.warning("no growth board (every sync on CUDA asks the broker): %s", exc)
        self.by_name: dict[str, Growable] = {}
        self.bytes_by_pool: collections.Counter = collections.Counter()
        self.stocks: dict[str, ChunkStock] = {}   # pool -> its chunks made ahead (CUDA)
        self.loans = Loans()   # of those chunks, lent to sessions ahead of their grows
        self._refill_after = 0.0   # a refill failed (the device is full): not again before then
        self._stock_settled = False   # nothing to make until buffers change (saves pool queries)
        self._grew = False   # a create or grow since the last refill_quick
        self._ids = itertools.count(1)

    def _check_size(self, pool_name: str, nbytes: int, more: int) -> None:
        """Refuse a buffer of ``nbytes`` (``more`` of them new) that is too large for any pool, or
        would take its pool past its max_size (allocations and growable buffers together)."""
        if nbytes > MAX_GROWABLE:
            raise AllocationTooLarge(f"a growable buffer of {nbytes} bytes is too large (at most {MAX_GROWABLE})")
        pool = self.registry.pool(pool_name)
        limit = pool.usage.byte_limit
        if limit:
            held = pool.usage.stats().used + self.bytes_by_pool[pool_name]
            if held + more > limit:
                raise OutOfMemory(
                    f"pool {pool_name!r} holds {held} bytes (allocations and growable buffers); {more} "
                    f"more would pass its max_size of {limit} bytes"
                )

    # -- the stock of chunks ------------------------------------------------------------------
    def open_stocks(self, target: int) -> None:
        """A stock of ``target`` bytes for each pool that can use one, filled now (at start)."""
        for name, pool in self.registry.pools.items():
            if target and not pool.read_only:
                try:
                    stock = self.registry.backend.chunk_stock(pool.spec, target)
                except IpcPoolError as exc:   # e.g. a device without VMM: no growth there, no stock
                    log.warning("pool %r keeps no growth stock: %s", name, exc)
                    continue
                if stock is not None and stock.sizes:
                    self.stocks[name] = stock
        while self.refill_stock():
            pass

    def _room(self, pool_name: str) -> int:
        """Bytes the stock of a pool may hold: its max_size less what its buffers and allocations
        hold (no limit: the stock's own target bounds it)."""
        limit = self.registry.pool(pool_name).usage.byte_limit
        if not limit:
            return MAX_GROWABLE
        return max(0, limit - self.registry.pool(pool_name).usage.stats().used - self.bytes_by_pool[pool_name])

    def stock_wanted(self) -> bool:
        """Is there a chunk to make (the broker's idle pass then calls ``refill_stock``)?"""
        if self._stock_settled or not self.stocks or time.monotonic() < self._refill_after:
            return False
        wanted = any(s.wanted(self._room(p) - s.bytes) is not None for p, s in self.stocks.items())
        self._stock_settled = not wanted
        return wanted

    def refill_stock(self, most: int | None = None) -> bool:
        """Make one chunk (at most ``most`` bytes) for the first stock that wants one; False when
        none did (or it failed)."""
        if time.monotonic() < self._refill_after:
            return False
        for pool_name, stock in self.stocks.items():
            try:
                if stock.refill_one(self._room(pool_name) - stock.bytes, most):
                    return True
            except IpcPoolError as exc:   # the device is full now: try again in a while
                log.warning("pool %r: no chunk made for the growth stock: %s", pool_name, exc)
                self._refill_after = time.monotonic() + 1.0
                return False
        return False

    def refill_quick(self) -> None:
        """After answering a control request: one small chunk, once per create or grow (the
        others, and a stock that lacks only big chunks, cost nothing here)."""
        if self._grew:
            self._grew = False
            self.refill_stock(QUICK_CHUNK)

    def _fit_stock(self, pool_name: str, quick: bool = True) -> None:
        """After a pool's buffers grew: the stock gives up what no longer fits its max_size."""
        stock = self.stocks.get(pool_name)
        if stock is not None:
            stock.shed(self._room(pool_name))
            self._stock_settled = False   # what was taken is made again while idle
            self._grew |= quick           # ... and a small chunk of it at once (refill_quick)

    def lend(self, session: Session, g: Growable, count: int) -> list[tuple[int, Any]]:
        """Lend ``session`` what the stock of ``g``'s pool holds (``broker.loans``), as far as its
        quota allows, ``count`` chunks at most: (id, chunk) each; none where ``g`` cannot take them
        or is another uid's."""
        stock = self._lender(session, g)
        if stock is None or not stock.held:   # (asked after every grow: most often nothing is held)
            return []
        quota = self.registry.config.quota_for(g.uid).bytes
        room = quota - self.registry.bytes_by_uid[g.uid] if quota else MAX_GROWABLE
        lent = self.loans.lend(session, g.pool, stock, room, count)
        if lent:   # the grower's next steps come from the loan: no refill beside them until quiet
            self._grew = False
        return lent

    def _take_loan(self, session: Session, g: Growable, nbytes: int, ids: list[int] | None, first: int | None) -> bool:
        """Grow ``g`` with the loaned chunks ``ids`` where they are exactly the step to ``nbytes``
        and ``g`` is as the client mapped it (``first`` chunks); False (nothing taken) else."""
        stock = self._lender(session, g)
        if not ids or first != len(g.memory.chunks) or stock is None:
            return False
        step = round_up(nbytes, stock.gran) - g.memory.size
        chunks = self.loans.take(session, g.pool, ids, step)
        if chunks is None:
            return False
        g.memory.add(chunks)
        for c in chunks:
            stock.lent_used(c)
        return True

    def _lender(self, session: Session, g: Growable) -> ChunkStock | None:
        """The stock whose chunks ``session`` may borrow for ``g``: its pool's, where ``g`` takes
        them (see ``BrokerGrowable.takes_from``) and is the session's uid's."""
        stock = self.stocks.get(g.pool)
        if stock is None or session.cred.uid != g.uid or not g.memory.takes_from(stock):
            return None
        return stock

    def _end_loan(self, session: Session, pool_name: str) -> None:
        self.loans.end(session, pool_name, self.stocks.get(pool_name))
        self._stock_settled = False   # sizes to make again

    def close_stocks(self) -> None:
        """Release every stocked chunk (at shutdown: they are no buffer's, nothing stores them)."""
        for session, pool_name in self.loans.all():
            self._end_loan(session, pool_name)
        for stock in self.stocks.values():
            stock.close()
        self.stocks.clear()

    # -- buffers --------------------------------------------------------------------------------
    def create(self, session: Session, name: str, nbytes: int, pool_name: str, compression: bool) -> Growable:
        if nbytes <= 0:
            raise InvalidRequest(f"growable size must be positive, got {nbytes}")
        if name in self.by_name:
            raise ObjectExists(f"a growable buffer named {name!r} already exists")
        pool = self.registry.pool(pool_name)
        self._check_size(pool_name, nbytes, nbytes)
        uid = session.cred.uid
        self.registry.check_quota(uid, nbytes)
        memory = self.registry.backend.create_growable(pool.spec, nbytes, compression, self.stocks.get(pool_name))
        g = Growable(next(self._ids), name, pool_name, uid, memory, compression)
        self._take_word(g)
        self.registry.bytes_by_uid[uid] += memory.size
        self.bytes_by_pool[pool_name] += memory.size
        self._fit_stock(pool_name)
        self.by_name[name] = g
        g.holders[session] += 1
        return g

    def restore(self, rows: list[dict], take_fds) -> int:
        """Restore the growables a previous broker stored (``take_fds(gid, count)`` gives their
        FDs), attached to nobody yet, under their old ids (their FD names); returns how many."""
        n = 0
        for row in rows:
            try:
                fds = take_fds(row["gid"], row["fds"])
                if fds is None:
                    raise InvalidRequest("its FDs are not in the store")
                spec = self.registry.pool(row["pool"]).spec
                memory = self.registry.backend.adopt_growable(spec, row["info"], list(row["chunks"]), fds)
            except (IpcPoolError, KeyError, TypeError, OSError) as exc:
                log.error("stored growable %r not restored: %s", row.get("name"), exc)
                continue
            g = Growable(row["gid"], row["name"], row["pool"], row.get("uid", 0), memory,
                         bool(row.get("compression_requested")), gen=row.get("gen", 0), stored=row["fds"])
            self._take_word(g)
            self.registry.bytes_by_uid[g.uid] += memory.size
            self.bytes_by_pool[g.pool] += memory.size
            self.by_name[g.name] = g
            n += 1
        self._ids = itertools.count(max([g.gid for g in self.by_name.values()], default=0) + 1)
        return n

    def find(self, name: str) -> Growable:
        g = self.by_name.get(name)
        if g is None or g.deleted:
            raise ObjectNotFound(f"no growable buffer named {name!r}")
        return g

    def attached(self, session: Session, name: str) -> Growable:
        g = self.by_name.get(name)
        if g is None or not g.holders.get(session):
            raise InvalidRequest(f"this session is not attached to growable buffer {name!r}")
        return g

    def attach(self, session: Session, name: str) -> Growable:
        g = self.find(name)
        g.holders[session] += 1
        return g

    def grow(self, session: Session, name: str, nbytes: int, loan: list[int] | None = None,
             first: int | None = None) -> tuple[Growable, list[Session], bool]:
        """Grow to at least ``nbytes``, with the loaned chunks ``loan`` where they fit (see
        ``_take_loan``); returns it, the other sessions to tell, and whether the loan was taken."""
        g = self.attached(session, name)
        if nbytes <= g.memory.size:
            return g, [], False
        if len(g.memory.chunks) >= MAX_CHUNKS:
            raise InvalidRequest(f"growable buffer {name!r} has {MAX_CHUNKS} chunks; grow it in larger steps")
        before = g.memory.size
        self._check_size(g.pool, nbytes, nbytes - before)
        self.registry.check_quota(g.uid, nbytes - before)
        took = self._take_loan(session, g, nbytes, loan, first)
        if not took:
            g.memory.grow(nbytes, self.stocks.get(g.pool))
        self.registry.bytes_by_uid[g.uid] += g.memory.size - before
        self.bytes_by_pool[g.pool] += g.memory.size - before
        # A grower that took its loan may be mapping the next step already: no refill of ours
        # on the device meanwhile (the stock's chunk is made again once quiet).
        self._fit_stock(g.pool, quick=not took)
        g.gen += 1
        if self.board is not None:   # before anyone is answered or told (see ipcpool.shm.growboard)
            g.stamp = self.board.stamp(g.word)
        return g, [s for s in g.holders if s is not session], took

    def fds(self, session: Session, name: str, first: int) -> tuple[Growable, list[int]]:
        g = self.attached(session, name)
        if not 0 <= first < len(g.memory.chunks):
            raise InvalidRequest(f"growable buffer {name!r} has {len(g.memory.chunks)} chunks, not chunk {first}")
        return g, g.memory.fds(first)

    def detach(self, session: Session, name: str) -> Growable | None:
        """One attachment less; returns the buffer if that destroyed it (deleted, and held no more)."""
        g = self.attached(session, name)
        g.holders[session] -= 1
        if g.holders[session] <= 0:
            del g.holders[session]
            if not any(session in o.holders for o in self.by_name.values() if o.pool == g.pool):
                self._end_loan(session, g.pool)   # its last buffer of the pool
        return self._destroy_if_done(g)

    def delete(self, name: str) -> Growable | None:
        g = self.find(name)
        g.deleted = True
        return self._destroy_if_done(g)

    def end_session(self, session: Session) -> list[Growable]:
        """Detach ``session`` from every buffer; returns those this destroyed."""
        for pool_name in self.loans.pools(session):
            self._end_loan(session, pool_name)
        destroyed = []
        for g in list(self.by_name.values()):
            if g.holders.pop(session, None) is not None and self._destroy_if_done(g) is not None:
                destroyed.append(g)
        return destroyed

    def _destroy_if_done(self, g: Growable) -> Growable | None:
        if not g.deleted or g.holders:
            return None
        # Every client has unmapped it (detach comes after the client's unmap), so the chunks go.
        del self.by_name[g.name]
        self.registry.bytes_by_uid[g.uid] -= g.memory.size
        self.bytes_by_pool[g.pool] -= g.memory.size
        g.memory.close()
        if self.board is not None:
            self.board.give_back(g.word)   # its next holder stamps it anew first
        self._stock_settled = False   # room came back under the pool's max_size
        return g

    def _take_word(self, g: Growable) -> None:
        if self.board is not None:
            g.word, g.stamp = self.board.take()

    def stats(self) -> dict[str, dict]:
        """Per pool: its growable buffers and the bytes they hold."""
        out: dict[str, dict] = {}
        for g in self.by_name.values():
            row = out.setdefault(g.pool, {"growables": 0, "growable_bytes": 0})
            row["growables"] += 1
            row["growable_bytes"] += g.memory.size
        for pool_name, stock in self.stocks.items():   # only pools that keep a stock show one
            row = out.setdefault(pool_name, {"growables": 0, "growable_bytes": 0})
            row["stock_bytes"], row["lent_bytes"] = stock.bytes, self.loans.bytes_in(pool_name)
        return out

    def list(self, prefix: str = "") -> list[dict]:
        return [g.describe() for name, g in sorted(self.by_name.items()) if name.startswith(prefix)]

    def close(self) -> None:
        for g in self.by_name.values():
            g.memory.close()
        self.by_name.clear()
        self.close_board()

    def close_board(self) -> None:
        if self.board is not None:
            self.board.close()
            self.board = None
