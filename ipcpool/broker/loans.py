"""Chunks of a pool's growth stock lent to a session ahead of its grows, so that a grow costs the
grower no chunk FD, no import and no mapping on the way back.

A session that creates or grows a growable buffer on the control socket is lent the stock's held
chunks in the reply (their FDs after the chunks', ``lend``: ``[[id, size], ...]``); it imports
them while it does other work. Its next grow names loaned chunks whose sizes add up to exactly the
step (``loan``), maps them while the broker records the grow, and the reply says ``took``: the
broker took them, in that order, as the buffer's next chunks. The broker takes them only where the
buffer still has the chunks the client mapped (``first``, no other process grew it meanwhile);
otherwise it grows the buffer as it would without a loan, and the client maps that instead (its
loan stays its own). The broker alone orders grows, stamps the growth board and tells the other
holders, as for every grow: a loan saves work, it changes no rule.

A loan is the stock's until a grow takes it: counted against the pool's max_size, charged to
nobody, and no bigger than the room left in the borrower's quota (taking it is a grow, charged and
checked as any). It ends when the session detaches from its last buffer of the
pool, or ends: what it did not use is released, never lent again nor handed to anyone else (the
borrower held those FDs).
"""

from __future__ import annotations

import itertools
from typing import Any

from ..backend.stock import ChunkStock
from .session import Session


class Loans:
    def __init__(self) -> None:
        self._held: dict[tuple[Session, str], dict[int, Any]] = {}   # (session, pool) -> id -> chunk
        self._ids = itertools.count(1)

    def lend(self, session: Session, pool: str, stock: ChunkStock, most: int, count: int) -> list[tuple[int, Any]]:
        """Lend ``session`` up to ``most`` bytes (``count`` chunks) of what ``stock`` holds:
        (id, chunk) each."""
        chunks = stock.lend(most, count)
        if not chunks:
            return []
        held = self._held.setdefault((session, pool), {})
        out = [(next(self._ids), c) for c in chunks]
        held.update(out)
        return out

    def bytes_in(self, pool: str) -> int:
        """Bytes lent out of ``pool``'s stock, to every session."""
        return sum(c.size for (_, p), held in self._held.items() if p == pool for c in held.values())

    def take(self, session: Session, pool: str, ids: list[int], total: int) -> list[Any] | None:
        """The chunks ``ids`` of the session's loan, in that order, no longer lent; None (and
        nothing taken) unless it holds each of them, once, and they are ``total`` bytes."""
        held = self._held.get((session, pool), {})
        if len(set(ids)) != len(ids) or any(i not in held for i in ids) or sum(held[i].size for i in ids) != total:
            return None
        chunks = [held.pop(i) for i in ids]
        if not held:
            del self._held[(session, pool)]
        return chunks

    def end(self, session: Session, pool: str, stock: ChunkStock | None) -> int:
        """The loan's end: its chunks released (see the module doc); returns their bytes."""
        held = self._held.pop((session, pool), {})
        chunks = list(held.values())
        if stock is not None:
            stock.lent_back(chunks)
        else:   # the stock closed first (shutdown)
            for c in chunks:
                c.close()
        return sum(c.size for c in chunks)

    def pools(self, session: Session) -> list[str]:
        return [pool for (s, pool) in self._held if s is session]

    def all(self) -> list[tuple[Session, str]]:
        return list(self._held)
