"""The host client backend: a pool's memfd mapped once; allocations are views at their offsets."""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any

from ...fds import close_all
from ...errors import BackendUnavailable, InvalidRequest
from ..base import UNRECORDED, ClientBackend, ClientGrowable, ClientPool, Export, ImportedMemory
from .growable import HostClientGrowable


class _Mapping:
    """A shared mapping of one pool. Buffers keep it alive: it is unmapped when the last goes."""

    def __init__(self, fd: int, size: int):
        self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        probe = ctypes.c_ubyte.from_buffer(self.mm)  # a short-lived export, just for the address
        self.address = ctypes.addressof(probe)
        del probe
        self.view = memoryview(self.mm)


class HostMemory(ImportedMemory):
    def __init__(self, mapping: _Mapping, offset: int, size: int, whole: HostMemory | None = None):
        self._mapping = mapping
        self.offset = offset
        self.size = size
        self._whole = whole   # the pool's whole mapping as one memory (None: this is it)
        self._view: memoryview | None = None

    @property
    def view(self) -> memoryview:
        """Made on first use: a batch of leases may never need one. (Not a ``cached_property``:
        Python 3.11's takes a lock on every read, ~2 µs of a reader's hand-off.)"""
        view = self._view
        if view is None:
            view = self._view = self._mapping.view[self.offset : self.offset + self.size]
        return view

    @property
    def ptr(self) -> int:
        return self._mapping.address + self.offset

    def slab(self) -> tuple[HostMemory, int]:
        """The pool's whole mapping and this memory's offset there: arrays of many objects are
        views of one array over it."""
        return (self if self._whole is None else self._whole), self.offset


class HostClientPool(ClientPool):
    def __init__(self, info: dict[str, Any], fd: int):
        try:
            size = info["size"]
            if os.fstat(fd).st_size < size:
                raise InvalidRequest(f"pool {info.get('name')!r}: FD smaller than announced size")
            self._mapping = _Mapping(fd, size)
            self._whole = HostMemory(self._mapping, 0, size)
        finally:
            os.close(fd)  # the mapping keeps the memory; the FD is no longer needed
        self.size = size

    def import_allocation(self, export: Export, stream: Any = None, fds: list[int] = ()) -> ImportedMemory:
        close_all(fds)
        if export.offset + export.size > self.size:
            raise InvalidRequest("allocation lies outside the pool")
        return HostMemory(self._mapping, export.offset, export.size, self._whole)

    def import_many(self, exports: list[Export], stream: Any = None) -> list[ImportedMemory]:
        mapping, size, whole = self._mapping, self.size, self._whole
        if any(e.offset + e.size > size for e in exports):
            raise InvalidRequest("allocation lies outside the pool")
        return [HostMemory(mapping, e.offset, e.size, whole) for e in exports]

    def release(self, memory: ImportedMemory, stream: Any = None, credit: bytes = b"", *,
                if_busy: bool = False) -> bytes:
        return b""

    def seal_target(self, memory: ImportedMemory, credit: bytes) -> tuple[Any, None] | None:
        return (UNRECORDED, None) if isinstance(memory, HostMemory) else None   # (nothing to record: the post and frame)

    def carved(self, arena: ImportedMemory, offset: int, nbytes: int) -> ImportedMemory:
        if not isinstance(arena, HostMemory) or offset + nbytes > arena.size:
            raise InvalidRequest("a carved range lies outside its arena")
        return HostMemory(arena._mapping, arena.offset + offset, nbytes, arena._whole)

    def close(self) -> None:
        # Buffers still alive keep the mapping (and thus their memory) valid; see _Mapping.
        self._mapping = self._whole = None


class HostClientBackend(ClientBackend):
    name = "host"

    def import_pool(self, info: dict[str, Any], fd: int) -> ClientPool:
        try:
            return HostClientPool(info, fd)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise BackendUnavailable(f"cannot map host pool {info.get('name')!r}: {exc}") from exc

    def import_growable(self, info: dict[str, Any], span: int | None = None) -> ClientGrowable:
        return HostClientGrowable()
