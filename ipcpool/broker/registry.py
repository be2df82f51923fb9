"""Pools and allocations, with holders and per-uid accounting.

An allocation has holders: sessions (the one that allocated it, sessions that opened it or hold a
lease on it) and named objects (an object holds its memory until it is deleted). It is freed once,
when its last holder lets go; each holder's done event reaches the backend as it arrives (R2, R4).
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ..backend.base import BrokerBackend, BrokerPool, Export
from ..config import Config
from ..errors import InvalidRequest, OutOfMemory, QuotaExceeded, UnknownPool
from .session import Session

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Allocation:
    aid: int
    pool: BrokerPool
    handle: object
    export: Export
    uid: int
    holders: collections.Counter = field(default_factory=collections.Counter)
    share_token: bytes | None = None
    charged: bool = True   # counted in its uid's bytes (a range carved from an arena is not: the arena is)

    @property
    def size(self) -> int:
        return self.export.size


class Registry:
    def __init__(self, config: Config, backend: BrokerBackend):
        self.config = config
        self.backend = backend
        self.pools: dict[str, BrokerPool] = {}
        self.allocations: dict[int, Allocation] = {}
        self.count_by_pool: collections.Counter = collections.Counter()   # pool name -> allocations (stats: no scan)
        self.by_token: dict[bytes, Allocation] = {}
        self.bytes_by_uid: collections.Counter = collections.Counter()
        self.renamed: dict[str, str] = {}   # configured name -> its read-only restored generation
        self.on_pool_emptied = lambda pool: None   # a read-only pool's last allocation went
        # Memory kept for later (checkpoints' spares) given back where ``pool`` or ``uid``'s quota
        # ran short; True where any went, and the allocation is tried once more.
        self.reclaim: Callable[[str, int], bool] = lambda pool, uid: False
        self._next_aid = 1

    def create_pools(self, durable=None) -> None:
        """Create the configured pools, restoring what ``durable`` (the FD store) still has. A pool
        restored read-only (its memory restored objects live in) is renamed ``<name>~<n>``, and a
        fresh pool of the same spec serves new allocations under the configured name."""
        specs = {s.name: s for s in self.config.pools}
        stored = durable if durable is not None and self.backend.durable else None
        try:
            for name, fd in stored.older_pools() if stored else []:   # from earlier restarts
                spec = specs.get(name.split("~")[0])
                if spec is None:
                    os.close(fd)
                    continue
                self.pools[name] = self.backend.adopt_pool(replace(spec, name=name), fd, stored.pool_info(name))
            for spec in self.config.pools:
                fd = stored.take_pool_fd(spec.name) if stored else None
                if fd is None:
                    self.pools[spec.name] = self.backend.create_pool(spec)
                    continue
                pool = self.backend.adopt_pool(spec, fd, stored.pool_info(spec.name))
                if pool.read_only:
                    old = next(f"{spec.name}~{n}" for n in itertools.count(1) if f"{spec.name}~{n}" not in self.pools)
                    pool.spec = replace(spec, name=old)
                    self.pools[old] = pool
                    self.renamed[spec.name] = old
                    self.pools[spec.name] = self.backend.create_pool(spec)
                    log.info("pool %s adopted from the FD store as %s (read-only)", spec.name, old)
                else:
                    self.pools[spec.name] = pool
                    log.info("pool %s adopted from the FD store", spec.name)
        except BaseException:
            self.close()
            raise

    def restore(self, row: dict, fds: list[int]) -> Allocation:
        """An allocation that survived a restart (of a stored object), held by nobody yet.
        Memory of a pool restored read-only is found under its new name; VMM chunks are restored by
        the configured pool itself."""
        name = row["pool"] if row.get("chunks") else self.renamed.get(row["pool"], row["pool"])
        try:
            pool = self.pool(name)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        uid, nbytes = row.get("uid", 0), row["size"]
        handle, export = pool.restore(row, fds)
        alloc = Allocation(self._next_aid, pool, handle, export, uid)
        self._next_aid += 1
        self.allocations[alloc.aid] = alloc
        self.count_by_pool[alloc.pool.spec.name] += 1
        self.bytes_by_uid[uid] += nbytes
        return alloc

    def pool(self, name: str) -> BrokerPool:
        try:
            return self.pools[name]
        except KeyError:
            raise UnknownPool(
                f"no pool named {name!r}; this broker has {', '.join(sorted(self.pools))}"
            ) from None

    def allocate(self, session: Session, nbytes: int, pool_name: str) -> Allocation:
        """A new allocation, held once by ``session`` and counted against its uid's quota."""
        pool = self.pool(pool_name)
        if nbytes <= 0:
            raise InvalidRequest(f"allocation size must be positive, got {nbytes}")
        uid = session.cred.uid
        try:
            self.check_quota(uid, nbytes)
            handle, export = pool.allocate(nbytes, session.backend)
        except (OutOfMemory, QuotaExceeded):
            if not self.reclaim(pool.spec.name, uid):
                raise
            self.check_quota(uid, nbytes)
            handle, export = pool.allocate(nbytes, session.backend)
        alloc = Allocation(self._next_aid, pool, handle, export, uid)
        self._next_aid += 1
        self.allocations[alloc.aid] = alloc
        self.count_by_pool[alloc.pool.spec.name] += 1
        self.bytes_by_uid[uid] += nbytes
        self.hold(alloc, session)
        return alloc

    def carve(self, session: Session, arena: Allocation, offset: int, nbytes: int, on_idle) -> Allocation:
        """A range of ``arena`` as an allocation of its own, held once by ``session``; its bytes are
        the arena's, already counted."""
        handle, export = arena.pool.arenas.carve(arena.handle, arena.export, offset, nbytes, on_idle)
        alloc = Allocation(self._next_aid, arena.pool, handle, export, arena.uid, charged=False)
        self._next_aid += 1
        self.allocations[alloc.aid] = alloc
        self.count_by_pool[alloc.pool.spec.name] += 1
        self.hold(alloc, session)
        return alloc

    def check_quota(self, uid: int, nbytes: int) -> None:
        """Refuse ``nbytes`` more for ``uid`` where that would pass its byte quota."""
        quota = self.config.quota_for(uid).bytes
        held = self.bytes_by_uid[uid]
        if quota and held + nbytes > quota:
            raise QuotaExceeded(
                f"uid {uid} holds {held} bytes; {nbytes} more would pass its quota of {quota} bytes: "
                "free some memory or ask the operator to raise quotas"
            )

    def hold(self, alloc: Allocation, holder: object) -> None:
        alloc.holders[holder] += 1
        if isinstance(holder, Session):
            holder.held[alloc.aid] += 1

    def hold_many(self, allocs: list[Allocation], session: Session) -> None:
        """One more hold by ``session`` on each of ``allocs`` (a batch of leases)."""
        held = session.held
        for alloc in allocs:
            alloc.holders[session] += 1
            held[alloc.aid] += 1

    def held_by(self, session: Session, aid: int) -> Allocation:
        if not session.held.get(aid):
            raise InvalidRequest(f"allocation {aid} is not held by this session")
        return self.allocations[aid]

    def share(self, session: Session, aid: int) -> bytes:
        alloc = self.held_by(session, aid)
        if alloc.share_token is None:
            alloc.share_token = secrets.token_bytes(16)
            self.by_token[alloc.share_token] = alloc
        return alloc.share_token

    def open(self, session: Session, token: bytes) -> Allocation:
        alloc = self.by_token.get(token)
        if alloc is None:
            raise InvalidRequest("no shared allocation has that token (freed, or never shared)")
        self.hold(alloc, session)
        return alloc

    def free(self, session: Session, aid: int, done_event: bytes = b"") -> Allocation:
        """``session`` lets go of one hold on ``aid`` (after ``done_event``, where given)."""
        alloc = self.held_by(session, aid)
        session.held[aid] -= 1
        if not session.held[aid]:
            del session.held[aid]
        self.unhold(alloc, session, done_event, session)
        return alloc

    def unhold(self, alloc: Allocation, holder: object, done_event: bytes, via: Session | None) -> None:
        """Drop one hold; free the memory after the last. ``via`` is the session on whose stream
        the backend orders the work (None: any live context will do, nothing to wait for)."""
        alloc.holders[holder] -= 1
        if alloc.holders[holder] <= 0:
            del alloc.holders[holder]
        ctx = via.backend if via is not None else None
        if alloc.holders:
            if done_event and ctx is not None:
                alloc.pool.ordering.add_release(alloc.handle, ctx, done_event)
            return
        del self.allocations[alloc.aid]
        self.count_by_pool[alloc.pool.spec.name] -= 1
        if alloc.share_token is not None:
            del self.by_token[alloc.share_token]
        if alloc.charged:
            self.bytes_by_uid[alloc.uid] -= alloc.size
        alloc.pool.free(alloc.handle, ctx if ctx is not None else self.backend.broker_context(), done_event)
        if alloc.pool.read_only and not any(a.pool is alloc.pool for a in self.allocations.values()):
            self._drop_pool(alloc.pool)

    def drop_empty_generations(self) -> None:
        """After a restore: read-only generations no restored allocation lives in."""
        for pool in [p for p in self.pools.values() if p.read_only]:
            if not any(a.pool is pool for a in self.allocations.values()):
                self._drop_pool(pool)

    def _drop_pool(self, pool: BrokerPool) -> None:
        """A read-only generation holds nothing any more: let its memory go (with the FD store's
        copy; clients that still have it imported keep theirs until they close)."""
        name = pool.spec.name
        del self.pools[name]
        self.renamed = {k: v for k, v in self.renamed.items() if v != name}
        self.on_pool_emptied(pool)
        pool.close()
        log.info("pool %s: its last restored allocation is gone; released", name)

    def end_session(self, session: Session) -> int:
        """Drop every hold of a session (it said bye, or its process is gone)."""
        count = 0
        for aid, n in list(session.held.items()):
            for _ in range(n):
                self.free(session, aid)
            count += 1
        return count

    def stats(self) -> dict[str, dict]:
        return {name: {**pool.usage.stats().as_dict(), "allocations": self.count_by_pool[name]}
                for name, pool in self.pools.items()}

    def close(self) -> None:
        for pool in self.pools.values():
            try:
                pool.close()
            except Exception:
                log.exception("closing pool %s", pool.spec.name)
        self.pools.clear()
