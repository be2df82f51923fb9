"""Host memory: a pool is a sparse memfd; clients map it once and address allocations by offset.

"reserved" is what the memfd actually holds in pages (st_blocks), so it counts what any process
wrote, and trimming punches holes in freed page ranges to give them back to the OS.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any

from ...fds import OwnedFd, close_all
from ...errors import InvalidRequest
from ...ranges import RangeAllocator
from ..base import Arenas, BrokerPool, Export, PoolSpec, PoolStats, SessionContext, Usage

DEFAULT_MAX_SIZE = 8 << 30
ALIGNMENT = 256
PAGE = mmap.PAGESIZE

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
# The process's own symbols hold libc: no library search (find_library runs ldconfig, ~3 ms).
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)


def punch_hole(fd: int, offset: int, length: int) -> None:
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fallocate(PUNCH_HOLE): {os.strerror(err)}")


class _Carved:
    """A range of an arena: freeing it hands it back to the arena, not to the pool."""

    __slots__ = ("offset", "on_idle")

    def __init__(self, offset: int, on_idle):
        self.offset = offset
        self.on_idle = on_idle


class HostPool(Arenas, Usage, BrokerPool):
    """A memfd pool; it serves its arenas and usage itself, and orders nothing (``NULL_ORDERING``)."""

    def __init__(self, spec: PoolSpec, fd: int | None = None):
        """A new pool, or (``fd``) the memfd of one a previous broker left in systemd's store (restored)."""
        self.spec = spec
        size = spec.max_size or DEFAULT_MAX_SIZE
        restored = fd is not None
        with OwnedFd(fd if restored else os.memfd_create(f"ipcpool:{spec.name}", os.MFD_CLOEXEC)) as owned:
            if restored:
                os.set_inheritable(owned.fd, False)
                if os.fstat(owned.fd).st_size != size:
                    raise InvalidRequest(
                        f"pool {spec.name!r}: the stored pool holds {os.fstat(owned.fd).st_size} bytes, the "
                        f"config says {size}; keep max_size while objects are stored, or remove them first"
                    )
            os.ftruncate(owned.fd, size)  # sparse: no page is backed until written
            self._fd = owned.take()   # the pool's from here on (closed by ``close``)
        self._alloc = RangeAllocator(size, ALIGNMENT)
        self._parts: dict[int, set[int]] = {}   # a shrunk arena -> the offsets of its kept parts
        self._threshold = spec.release_threshold
        self._reserved_high = 0
        self._used_high = 0

    @property
    def fd(self) -> int:
        if self._fd < 0:
            raise InvalidRequest(f"pool {self.spec.name!r} is closed")
        return self._fd

    def pool_info(self) -> dict[str, Any]:
        return {"name": self.spec.name, "size": self._alloc.capacity}

    @property
    def byte_limit(self) -> int:
        return self.spec.max_size or self._alloc.capacity   # unset: the memfd's size

    def _reserved(self) -> int:
        return os.fstat(self._fd).st_blocks * 512

    def _note_highs(self) -> None:
        self._used_high = max(self._used_high, self._alloc.used)
        self._reserved_high = max(self._reserved_high, self._reserved())

    def allocate(self, nbytes: int, session: SessionContext) -> tuple[object, Export]:
        offset = self._alloc.allocate(nbytes)
        self._used_high = max(self._used_high, self._alloc.used)
        return offset, Export(size=nbytes, offset=offset)

    @property
    def arena_limit(self) -> int:
        return self._alloc.capacity // 16

    def carve(self, handle: object, export: Export, offset: int, nbytes: int, on_idle) -> tuple[object, Export]:
        if not isinstance(handle, int):
            raise InvalidRequest("only a pool allocation can be carved")
        return _Carved(handle + offset, on_idle), Export(size=nbytes, offset=handle + offset)

    def restore(self, row: dict[str, Any], fds: list[int]) -> tuple[object, Export]:
        close_all(fds)
        offset, nbytes = row["offset"], row["size"]
        self._alloc.reserve(offset, nbytes)
        self._used_high = max(self._used_high, self._alloc.used)
        return offset, Export(size=nbytes, offset=offset)

    def shrink(self, handle: object, keep: list[tuple[int, int]]) -> int:
        if not isinstance(handle, int) or handle in self._parts:
            return 0
        given = self._alloc.free(handle)
        self._parts[handle] = {handle + off for off, _ in keep}
        for off, size in keep:
            given -= self._alloc.reserve(handle + off, size)
        return given

    def free_part(self, handle: object, offset: int) -> None:
        parts = self._parts.get(handle)
        if parts is not None and handle + offset in parts:
            parts.discard(handle + offset)
            self._alloc.free(handle + offset)

    def free(self, handle: object, session: SessionContext, done_event: bytes = b"") -> None:
        # The host has no asynchronous work to wait for: the client's munmap-free release is done.
        if isinstance(handle, _Carved):
            handle.on_idle()
            return
        self._note_highs()
        parts = self._parts.pop(handle, None)
        for offset in parts if parts is not None else (handle,):   # a shrunk arena: what is left
            self._alloc.free(offset)
        if self._threshold is not None and self._reserved() > self._threshold:
            self.trim(self._threshold)

    def stats(self) -> PoolStats:
        self._note_highs()
        # Pages are backed when written, so memory handed out but not yet touched is not in
        # st_blocks; it is reserved all the same (used never shows above reserved).
        reserved = max(self._reserved(), self._alloc.used)
        return PoolStats(reserved, self._alloc.used, max(self._reserved_high, reserved), self._used_high)

    def reset_high(self) -> None:
        # As CUDA does: the high marks restart from the current values.
        self._reserved_high = self._reserved()
        self._used_high = self._alloc.used

    def trim(self, keep: int) -> None:
        self._note_highs()
        reserved = self._reserved()
        for offset, size in self._alloc.free_blocks():
            if reserved <= keep:
                break
            start = -(-offset // PAGE) * PAGE          # only whole pages inside the free block
            end = (offset + size) // PAGE * PAGE
            if end > start:
                punch_hole(self._fd, start, end - start)
                reserved = self._reserved()

    def set_release_threshold(self, nbytes: int) -> None:
        self._threshold = nbytes

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
