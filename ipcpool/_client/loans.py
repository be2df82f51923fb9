"""The chunks the broker lent this session ahead of its grows (``ipcpool.broker.loans``).

Each comes in a create's or grow's reply as an FD, kept as it is. A grow whose step they add up to
exactly names them (``plan``), and imports and maps them (``import_handles``) while the broker
records the grow; once the broker took them they are the buffer's (``taken``). Importing only what
a grow uses, on the calling thread, keeps the unused ones from costing anything: an import on a
worker thread competes with the grow's own driver calls. A loan is per pool, and ends, as in the
broker, when this session closes its last buffer of the pool: the FDs no buffer took are closed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..backend.base import ClientBackend

log = logging.getLogger(__name__)


@dataclass(eq=False)
class LoanedChunk:
    lid: int
    size: int
    device: int
    fd: int


class ChunkLoans:
    def __init__(self, backend: ClientBackend):
        self._backend = backend
        self._by_pool: dict[str, dict[int, LoanedChunk]] = {}

    def add(self, pool: str, device: int, lent: Sequence, fds: list[int]) -> None:
        """Chunks a reply lent (``[[id, size], ...]``, one FD each, owned here from now on)."""
        for i, fd in enumerate(fds):
            row = lent[i] if i < len(lent) else None
            ok = isinstance(row, (list, tuple)) and len(row) == 2 and all(
                isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in row)
            if ok and self._backend.maps_loans:
                self._by_pool.setdefault(pool, {})[row[0]] = LoanedChunk(row[0], row[1], device, fd)
            else:   # a malformed row, or a backend that maps none: nothing can use this chunk
                os.close(fd)
        held = self._by_pool.get(pool)
        if held:   # largest first, as plan takes them (sorted here, not at every grow)
            self._by_pool[pool] = dict(sorted(held.items(), key=lambda kv: -kv[1].size))

    def plan(self, pool: str, step: int) -> list[LoanedChunk]:
        """Loaned chunks of ``pool`` adding up to exactly ``step`` bytes, largest first; empty
        where they cannot."""
        out, need = [], step
        for c in self._by_pool.get(pool, {}).values():
            if 0 < c.size <= need:
                out.append(c)
                need -= c.size
        return out if need == 0 and out else []

    def import_handles(self, chunks: list[LoanedChunk]) -> list[tuple[Any, int]] | None:
        """``(handle, size)`` of each (their FDs stay open until ``taken``); None, with nothing
        left imported, where the driver refused one."""
        got: list[tuple[Any, int]] = []
        try:
            for c in chunks:
                got.append((self._backend.import_loaned(c.device, c.fd), c.size))
        except Exception as exc:   # noqa: BLE001 (the grow then maps them from the broker's FDs)
            log.warning("a lent chunk could not be imported: %s", exc)
            self.release(chunks[0].device if chunks else -1, got)
            return None
        return got

    def release(self, device: int, handles: list[tuple[Any, int]] | None) -> None:
        for handle, _ in handles or ():
            try:
                self._backend.release_loaned(device, handle)
            except Exception as exc:   # noqa: BLE001 (the process's end frees it)
                log.warning("a lent chunk's handle was not released: %s", exc)

    def taken(self, pool: str, chunks: list[LoanedChunk]) -> None:
        """The broker took them for a buffer: their FDs are closed (the buffer's mapping holds
        the imported handles; a process that follows gets the broker's own FDs)."""
        held = self._by_pool.get(pool, {})
        for c in chunks:
            if held.pop(c.lid, None) is not None:
                os.close(c.fd)

    def end(self, pool: str) -> None:
        """The loan's end: close what no buffer took."""
        for c in self._by_pool.pop(pool, {}).values():
            os.close(c.fd)

    def end_all(self) -> None:
        for pool in list(self._by_pool):
            self.end(pool)
