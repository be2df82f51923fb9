"""Pools and allocations, with ownership, shared opens and per-uid accounting.

An allocation is freed once: when its owner has freed it and every session that opened it has
released it (or died). Each release's done event is handed to the backend as it arrives (R2, R4).
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field

from ..backend.base import BrokerBackend, BrokerPool, Export
from ..config import Config
from ..errors import AllocationTooLarge, InvalidRequest, QuotaExceeded, UnknownPool
from .session import Session

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Allocation:
    aid: int
    pool: BrokerPool
    handle: object
    export: Export
    owner: Session | None
    uid: int
    share_token: bytes | None = None
    openers: dict[int, int] = field(default_factory=dict)  # session id -> open count


class Registry:
    def __init__(self, config: Config, backend: BrokerBackend):
        self.config = config
        self.backend = backend
        self.pools: dict[str, BrokerPool] = {}
        self.allocations: dict[int, Allocation] = {}
        self.by_token: dict[bytes, Allocation] = {}
        self.bytes_by_uid: dict[int, int] = {}
        self._next_aid = 1

    def create_pools(self) -> None:
        try:
            for spec in self.config.pools:
                self.pools[spec.name] = self.backend.create_pool(spec)
        except BaseException:
            self.close()
            raise

    def pool(self, name: str) -> BrokerPool:
        try:
            return self.pools[name]
        except KeyError:
            raise UnknownPool(
                f"no pool named {name!r}; this broker has {', '.join(sorted(self.pools))}"
            ) from None

    def allocate(self, session: Session, nbytes: int, pool_name: str) -> Allocation:
        pool = self.pool(pool_name)
        if nbytes <= 0:
            raise InvalidRequest(f"allocation size must be positive, got {nbytes}")
        limit = pool.max_allocation
        if limit is not None and nbytes > limit:
            raise AllocationTooLarge(
                f"{nbytes} bytes is more than one pool allocation may hold ({limit} bytes): "
                "importing a larger one crashes the importer; split it into smaller allocations"
            )
        uid = session.cred.uid
        quota = self.config.quota_for(uid).bytes
        held = self.bytes_by_uid.get(uid, 0)
        if quota and held + nbytes > quota:
            raise QuotaExceeded(
                f"uid {uid} holds {held} bytes; {nbytes} more would pass its quota of {quota} bytes: "
                "free some memory or ask the operator to raise quotas"
            )
        handle, export = pool.allocate(nbytes, session.backend)
        alloc = Allocation(self._next_aid, pool, handle, export, session, uid)
        self._next_aid += 1
        self.allocations[alloc.aid] = alloc
        self.bytes_by_uid[uid] = held + nbytes
        session.owned.add(alloc.aid)
        return alloc

    def _owned(self, session: Session, aid: int) -> Allocation:
        if aid not in session.owned:
            raise InvalidRequest(f"allocation {aid} is not held by this session")
        return self.allocations[aid]

    def share(self, session: Session, aid: int) -> bytes:
        alloc = self._owned(session, aid)
        if alloc.share_token is None:
            alloc.share_token = secrets.token_bytes(16)
            self.by_token[alloc.share_token] = alloc
        return alloc.share_token

    def open(self, session: Session, token: bytes) -> Allocation:
        alloc = self.by_token.get(token)
        if alloc is None:
            raise InvalidRequest("no shared allocation has that token (freed, or never shared)")
        alloc.openers[session.sid] = alloc.openers.get(session.sid, 0) + 1
        session.opened[alloc.aid] = session.opened.get(alloc.aid, 0) + 1
        return alloc

    def free(self, session: Session, aid: int, done_event: bytes = b"") -> None:
        """The owner frees, or an opener releases, one hold on ``aid``."""
        if aid in session.owned:
            alloc = self.allocations[aid]
            session.owned.discard(aid)
            alloc.owner = None
        elif session.opened.get(aid):
            alloc = self.allocations[aid]
            session.opened[aid] -= 1
            alloc.openers[session.sid] -= 1
            if not session.opened[aid]:
                del session.opened[aid]
                del alloc.openers[session.sid]
        else:
            raise InvalidRequest(f"allocation {aid} is not held by this session")
        self._settle(alloc, session, done_event)

    def _settle(self, alloc: Allocation, session: Session, done_event: bytes) -> None:
        if alloc.owner is not None or alloc.openers:
            if done_event:
                alloc.pool.add_release(alloc.handle, session.backend, done_event)
            return
        del self.allocations[alloc.aid]
        if alloc.share_token is not None:
            del self.by_token[alloc.share_token]
        self.bytes_by_uid[alloc.uid] -= alloc.export.size
        alloc.pool.free(alloc.handle, session.backend, done_event)

    def release_session(self, session: Session) -> int:
        """Drop everything a session holds (it said bye, or its process is gone)."""
        count = 0
        for aid in list(session.owned):
            self.free(session, aid)
            count += 1
        for aid, n in list(session.opened.items()):
            for _ in range(n):
                self.free(session, aid)
            count += 1
        return count

    def stats(self) -> dict[str, dict]:
        out = {}
        for name, pool in self.pools.items():
            s = pool.stats().as_dict()
            s["allocations"] = sum(1 for a in self.allocations.values() if a.pool is pool)
            out[name] = s
        return out

    def close(self) -> None:
        for pool in self.pools.values():
            try:
                pool.close()
            except Exception:
                log.exception("closing pool %s", pool.spec.name)
        self.pools.clear()
