"""The pools a client imported, each on first use with its seal board, the export a reply
carries (what a pool imports an allocation from), and importing one (its chunk FDs fetched where
the pool needs them)."""

from __future__ import annotations

import os
from typing import Any

from ..backend.base import ClientBackend, ClientPool, Export, ImportedMemory
from ..board import Board
from ..errors import ProtocolError
from .channel import Channel


class Pools:
    def __init__(self, channel: Channel, backend: ClientBackend):
        self._channel = channel
        self._backend = backend
        self.imported: dict[str, ClientPool] = {}
        self.boards: dict[str, Board] = {}   # pool name -> its seal board (``ipcpool.board``)

    def get(self, name: str) -> ClientPool:
        """Pool ``name``, imported from its FD (and its board mapped) the first time."""
        pool = self.imported.get(name)
        if pool is None:
            reply, fds = self._channel.control_call({"op": "pool_fd", "pool": name})
            if len(fds) != 2 or not isinstance(reply.get("info"), dict):
                for fd in fds:
                    os.close(fd)
                raise ProtocolError(f"pool {name!r}: expected its FD, its seal board's and its info, got {len(fds)} FD(s)")
            try:
                board = Board(fds[1], owner=False)
            except BaseException:
                os.close(fds[0])
                raise
            try:
                pool = self.imported[name] = self._backend.import_pool(reply["info"], fds[0])
            except BaseException:
                board.close()
                raise
            self.boards[name] = board
        return pool

    def import_allocation(self, aid: int, pool: str, export: Export, stream: Any = None,
                          fds: list[int] | None = None) -> ImportedMemory:
        """Allocation ``aid`` imported into ``pool``: from ``fds`` where given, else with its chunk
        FDs fetched over the control socket where the pool needs them (``ClientPool.needs_fds``)."""
        client_pool = self.get(pool)
        if fds is None:
            fds = self._channel.alloc_fds(aid, len(export.chunks)) if client_pool.needs_fds(export) else []
        return client_pool.import_allocation(export, stream, fds)

    def close(self) -> None:
        for pool in self.imported.values():
            pool.close()
        self.imported.clear()
        for board in self.boards.values():
            board.close()
        self.boards.clear()


def export_of(reply: dict) -> Export:
    """An allocation's export as a reply carries it."""
    return Export(size=reply["size"], offset=reply["offset"], data=reply["data"],
                  ready_event=reply["event"], sub=bool(reply.get("sub")),
                  chunks=tuple(reply.get("chunks") or ()))
