"""The pools a client imported, each on first use with its seal board, and importing an
allocation into one (its chunk FDs fetched where the pool needs them)."""

from __future__ import annotations

import logging
import os
from typing import Any

from .. import trace
from ..backend.base import ClientBackend, ClientPool, Export, ImportedMemory
from ..shm.sealboard import Board, event_query
from ..errors import ProtocolError
from ..fds import close_all
from ..replies import PoolFds
from ..shm.directory import DirectoryView
from ..shm.leases import ClientLeasePage
from .channel import Channel

log = logging.getLogger(__name__)


class Pools:
    def __init__(self, channel: Channel, backend: ClientBackend):
        self._channel = channel
        self._backend = backend
        self.imported: dict[str, ClientPool] = {}
        self.boards: dict[str, Board] = {}   # pool name -> its seal board (``ipcpool.shm.sealboard``)
        # pool name -> (its name directory, its index in lease slots), and this session's lease
        # page (``ipcpool.shm``): where a reader finds an object without a reply.
        self.directories: dict[str, tuple[DirectoryView, int]] = {}
        self.unpopulated: list[DirectoryView] = []   # directories mapped, their pages not yet (``populate``)
        self.lease_page: ClientLeasePage | None = None
        # pool name -> what its import sent for them, their FDs: mapped on first need (``map_directories``)
        self.unmapped: dict[str, tuple[PoolFds, list[int]]] = {}

    def get(self, name: str) -> ClientPool:
        """Pool ``name``, imported from its FD (and its board mapped) the first time."""
        pool = self.imported.get(name)
        if pool is None:
            if trace.hook is not None:
                trace.emit("client.pool_import", pool=name)
            reply, fds = self._channel.control_call({"op": "pool_fd", "pool": name})
            sent = PoolFds.decode(reply)
            if len(fds) != sent.fds or not isinstance(sent.info, dict):
                for fd in fds:
                    os.close(fd)
                raise ProtocolError(f"pool {name!r}: expected its FD, its seal board's and its info, got {len(fds)} FD(s)")
            try:
                board = Board(fds[1], owner=False)
            except BaseException:
                close_all([fds[0], *fds[2:]])
                raise
            try:
                pool = self.imported[name] = self._backend.import_pool(sent.info, fds[0])
                pool.query_event = event_query   # (the reader's check of a seal, in C where built)
            except BaseException:
                board.close()
                close_all(fds[2:])
                raise
            self.boards[name] = board
            if fds[2:]:
                self.unmapped[name] = (sent, fds[2:])
            if trace.hook is not None:
                trace.emit("client.pool_imported", pool=name)
        return pool

    def map_directories(self) -> None:
        """Map the name directories of the pools imported since (and the session's lease page with
        the first), where a reader or writer first needs one, not at the pool's import: a worker
        attaching its weights with ``get_many`` never reads them (~0.15 ms a pool on a 2-CPU host)."""
        unmapped, self.unmapped = self.unmapped, {}
        for name, (sent, fds) in unmapped.items():
            self._directory(name, sent, fds)

    def _directory(self, name: str, sent: PoolFds, fds: list[int]) -> None:
        """Map the pool's name directory (and the session's lease page, with the first one). A
        kernel without membarrier, or a bad file, leaves the pool without: its readers ask."""
        try:
            if len(fds) == 2:
                self.lease_page = ClientLeasePage(fds.pop())
            if fds:
                view = DirectoryView(fds.pop(), sent.directory)
                index = sent.pool_index
                if self.lease_page is not None and isinstance(index, int):
                    self.directories[name] = (view, index)
                    self.unpopulated.append(view)
                else:
                    view.close()
        except (OSError, ValueError, ProtocolError) as exc:
            close_all(fds)
            log.warning("pool %r: its name directory is not usable (%s); readers ask the broker", name, exc)

    @trace.phase("import")
    def import_allocation(self, aid: int, pool: str, export: Export, stream: Any = None,
                          fds: list[int] | None = None) -> ImportedMemory:
        """Allocation ``aid`` imported into ``pool``: from ``fds`` where given, else with its chunk
        FDs fetched over the control socket where the pool needs them (``ClientPool.needs_fds``)."""
        client_pool = self.get(pool)
        if fds is None:
            fds = self._channel.alloc_fds(aid, len(export.chunks)) if client_pool.needs_fds(export) else []
        return client_pool.import_allocation(export, stream, fds)

    def populate(self) -> None:
        """Map the pages of the directories mapped since (``DirectoryView.populate``): where a
        reader waits anyway, or after its release."""
        views, self.unpopulated = self.unpopulated, []
        for view in views:
            view.populate()

    def close(self) -> None:
        for _, fds in self.unmapped.values():
            close_all(fds)
        self.unmapped.clear()
        self.unpopulated.clear()
        for view, _ in self.directories.values():
            view.close()
        self.directories.clear()
        if self.lease_page is not None:
            self.lease_page.close()
            self.lease_page = None
        for pool in self.imported.values():
            pool.close()
        self.imported.clear()
        for board in self.boards.values():
            board.close()
        self.boards.clear()
