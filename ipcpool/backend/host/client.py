"""The host client backend: a pool's memfd mapped once; allocations are views at their offsets."""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any

from ...errors import BackendUnavailable, InvalidRequest
from ..base import ClientBackend, ClientGrowable, ClientPool, Export, ImportedMemory
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
    def __init__(self, mapping: _Mapping, offset: int, size: int):
        self._mapping = mapping
        self.offset = offset
        self.size = size
        self.view = mapping.view[offset : offset + size]

    @property
    def ptr(self) -> int:
        return self._mapping.address + self.offset


class HostClientPool(ClientPool):
    def __init__(self, info: dict[str, Any], fd: int):
        try:
            size = info["size"]
            if os.fstat(fd).st_size < size:
                raise InvalidRequest(f"pool {info.get('name')!r}: FD smaller than announced size")
            self._mapping = _Mapping(fd, size)
        finally:
            os.close(fd)  # the mapping keeps the memory; the FD is no longer needed
        self.size = size

    def import_allocation(self, export: Export, stream: Any = None, fds: list[int] = ()) -> ImportedMemory:
        for fd in fds:
            os.close(fd)
        if export.offset + export.size > self.size:
            raise InvalidRequest("allocation lies outside the pool")
        return HostMemory(self._mapping, export.offset, export.size)

    def release(self, memory: ImportedMemory, stream: Any = None, credit: bytes = b"") -> bytes:
        return b""

    def carved(self, arena: ImportedMemory, offset: int, nbytes: int) -> ImportedMemory:
        if not isinstance(arena, HostMemory) or offset + nbytes > arena.size:
            raise InvalidRequest("a carved range lies outside its arena")
        return HostMemory(arena._mapping, arena.offset + offset, nbytes)

    def close(self) -> None:
        # Buffers still alive keep the mapping (and thus their memory) valid; see _Mapping.
        self._mapping = None


class HostClientBackend(ClientBackend):
    name = "host"

    def import_pool(self, info: dict[str, Any], fd: int) -> ClientPool:
        try:
            return HostClientPool(info, fd)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise BackendUnavailable(f"cannot map host pool {info.get('name')!r}: {exc}") from exc

    def import_growable(self, info: dict[str, Any]) -> ClientGrowable:
        return HostClientGrowable()
