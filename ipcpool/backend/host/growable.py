"""Growable buffers on the host: one memfd that the broker grows, clients remap.

The client side mirrors CUDA virtual memory with mmap: an address range is reserved (PROT_NONE,
no backing), the memfd is mapped into it with MAP_FIXED, and growth maps the new tail right after
the current end when that range is free (MAP_FIXED_NOREPLACE refuses a taken one) or else maps the
whole file again at a new reserved range. Nothing is copied: every mapping shows the same pages.

A client keeps the memfd it was first sent: a grow only makes that file longer, so following
another process's grow is an fstat and an mmap of the tail here, with no request to the broker.
The broker keeps no stock of chunks ahead of need: a host chunk is a longer file (ftruncate of a
sparse memfd), which costs about nothing to make at the moment it is asked for.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any

from ...errors import InvalidRequest, OutOfMemory
from ...sizes import round_up
from ..base import BrokerGrowable, ClientGrowable
from ...fds import OwnedFd
from ..stock import ChunkStock

PAGE = mmap.PAGESIZE
PROT_NONE = 0
MAP_FIXED = 0x10
MAP_NORESERVE = 0x4000
MAP_FIXED_NOREPLACE = 0x100000
_MAP_FAILED = ctypes.c_void_p(-1).value

# The process's own symbols hold libc: no library search (find_library runs ldconfig, ~3 ms).
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)


def _mmap(addr: int, length: int, prot: int, flags: int, fd: int = -1, offset: int = 0) -> int | None:
    """libc mmap; None where the kernel refused (EEXIST for a taken fixed range)."""
    got = _libc.mmap(addr or None, length, prot, flags, fd, offset)
    if got is None or got == _MAP_FAILED:
        return None
    return got


def reserve(length: int, at: int = 0) -> int | None:
    """Reserve address space without memory. ``at``: exactly there, or None if it is taken."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
    got = _mmap(at, length, PROT_NONE, flags | (MAP_FIXED_NOREPLACE if at else 0))
    if at and got is not None and got != at:   # a kernel without NOREPLACE treats it as a hint
        _libc.munmap(got, length)
        return None
    return got


def unmap(addr: int, length: int) -> None:
    _libc.munmap(addr, length)


class HostGrowable(BrokerGrowable):
    """The broker's memfd; each grow extends it (sparse: pages exist once written)."""

    one_file = True

    def __init__(self, nbytes: int, fd: int | None = None, chunks: list[int] | None = None):
        with OwnedFd(os.memfd_create("ipcpool:growable", os.MFD_CLOEXEC) if fd is None else fd) as owned:
            self.fd = owned.fd   # (``grow`` writes through it)
            self.chunks: list[int] = []
            if chunks is not None:   # restored: the file already holds them
                if os.fstat(self.fd).st_size < sum(chunks):
                    raise InvalidRequest("a stored growable's memfd is smaller than its chunks")
                self.chunks = list(chunks)
            else:
                self.grow(nbytes)
            self.fd = owned.take()   # the buffer's from here on (closed by ``close``)

    def info(self) -> dict[str, Any]:
        return {"device": -1, "granularity": PAGE, "compression": False}

    def grow(self, nbytes: int, stock: ChunkStock | None = None) -> None:
        new = round_up(nbytes, PAGE)
        if new <= self.size:
            return
        try:
            os.ftruncate(self.fd, new)
        except OSError as exc:
            raise OutOfMemory(f"cannot grow a host buffer to {new} bytes: {exc}") from exc
        self.chunks.append(new - self.size)

    def fds(self, first: int) -> list[int]:
        return [self.fd]   # one file holds every chunk, at its offset

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class HostClientGrowable(ClientGrowable):
    """A client's view: reserved ranges with the memfd mapped in. Old ranges stay until close."""

    follows = True   # the memfd's length is the buffer's size: fstat sees every grow

    def __init__(self, headroom: int = 2):
        self.headroom = headroom
        self.ptr = 0
        self.size = 0
        self.reserved = 0
        self._ranges: list[tuple[int, int]] = []   # (address, length) reserved, for close
        self._fd = -1   # the memfd, kept from the first FD received (see the module doc)

    def extend(self, chunks: list[int], fds: list[int]) -> bool:
        try:
            if len(fds) != 1:
                raise InvalidRequest(f"a host growable is mapped from one FD, got {len(fds)}")
            if self._fd < 0:
                self._fd = fds.pop()   # kept: later growth is mapped from it
            new_size = self.size + sum(chunks)
            if os.fstat(self._fd).st_size < new_size:
                raise InvalidRequest("the growable's memfd is smaller than its announced chunks")
            return self._map_to(new_size)
        finally:
            for fd in fds:
                os.close(fd)

    def follow(self, size: int) -> bool | None:
        if self._fd < 0:
            return None   # nothing held yet: the first FD comes with the create or attach
        now = os.fstat(self._fd).st_size   # the broker grows the file before it answers anyone
        if now < size:
            return None
        return self._map_to(now) if now > self.size else False

    def _map_to(self, new_size: int) -> bool:
        """Map the file up to ``new_size``: the tail right after the mapped part, in the
        reservation or one reserved right after it; else the whole file at a new range."""
        moved = False
        if new_size > self.reserved:
            extra = round_up(new_size * self.headroom, PAGE) - self.reserved
            if self.ptr and reserve(extra, at=self.ptr + self.reserved) is not None:
                self._ranges.append((self.ptr + self.reserved, extra))   # in place
                self.reserved += extra
            else:
                length = round_up(new_size * self.headroom, PAGE)
                base = reserve(length)
                if base is None:
                    raise OutOfMemory(f"cannot reserve {length} bytes of address space")
                self._ranges.append((base, length))
                moved = bool(self.ptr)
                self.ptr, self.size, self.reserved = base, 0, length   # map everything anew
        flags = mmap.MAP_SHARED | MAP_FIXED
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        if _mmap(self.ptr + self.size, new_size - self.size, prot, flags, self._fd, self.size) is None:
            raise OutOfMemory(f"mmap of a growable failed: {os.strerror(ctypes.get_errno())}")
        self.size = new_size
        return moved

    def view(self) -> memoryview:
        return memoryview((ctypes.c_char * self.size).from_address(self.ptr)).cast("B")

    def close(self) -> None:
        for addr, length in self._ranges:
            unmap(addr, length)
        self._ranges.clear()
        self.ptr = self.size = self.reserved = 0
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
