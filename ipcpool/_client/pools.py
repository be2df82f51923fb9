"""The pools a client imported, each on first use with its seal board, and the export a reply
carries (what a pool imports an allocation from)."""

from __future__ import annotations

import os

from ..backend.base import ClientBackend, ClientPool, Export
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
