"""A memfd only its creator writes: mapped writable by the broker, then sealed against any new
writable mapping, write, shrink or grow, so a client that receives its FD can map it read-only and
nothing else; a client checks the seals before it trusts what it reads. The name directory, the
lease pages and the growth board are made here (the growth board checks its own seals: its size is
the broker's choice)."""

from __future__ import annotations

import fcntl
import mmap
import os
import sys

from ..errors import ProtocolError

F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)
READ_ONLY = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE
FIXED_SIZE = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW   # writable, never truncated


def create(name: str, length: int, seals: int) -> tuple[int, mmap.mmap]:
    """A memfd of ``length`` bytes mapped writable here, then sealed with ``seals``: (fd, map)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, length)
        mapping = mmap.mmap(fd, length)
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        except BaseException:
            mapping.close()
            raise
    except BaseException:
        os.close(fd)
        raise
    return fd, mapping


class Owned:
    """A memfd the broker made and maps (``create``), whose FD it hands to clients: both go at close."""

    fd: int
    _map: mmap.mmap | None

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
            os.close(self.fd)
            self.fd = -1


def words(mapping: mmap.mmap) -> memoryview:
    """``mapping`` as u64 words, each read or written in one aligned access: for every word one
    process reads while another writes it (versions, counts, ring heads). ``struct.pack_into``
    zeroes a field's bytes before it writes them, and a reader in between sees 0: a busy-polling
    broker once read a request ring's head so. Native words are the layouts' little-endian ones;
    release the view before the map closes (it cannot close while a view lives)."""
    return memoryview(mapping).cast("Q")


assert sys.byteorder == "little"   # (``words``)

try:   # a map's buffer held for the hot calls in C (``_native.c``), where built
    from ._native import Pinned as _Pinned
except ImportError:
    _Pinned = None


def pinned(mapping: mmap.mmap, writable: bool = False) -> object:
    """``mapping`` as the hot calls in C take it: its buffer held once (``_native.Pinned``), where
    asking an mmap for it at each call costs a CPU back from sleep ~1.5 µs of cold code (H100
    host); the map itself where the C part is not built. ``unpin`` it before the map closes."""
    return mapping if _Pinned is None else _Pinned(mapping, writable)


def unpin(held: object) -> None:
    """Give back what ``pinned`` held (a later C call on it raises, never reads the closed map)."""
    if _Pinned is not None and isinstance(held, _Pinned):
        held.release()


def map_received(fd: int, length: int, seals: int, what: str, *, writable: bool) -> mmap.mmap:
    """Map an FD the broker sent, after checking its size and seals; the FD is closed here."""
    try:
        st = os.fstat(fd)
        if st.st_size != length:
            raise ProtocolError(f"{what}: {st.st_size} bytes, expected {length}")
        if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & seals != seals:
            raise ProtocolError(f"{what} is not sealed as it must be")
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        return mmap.mmap(fd, length, access=access)
    finally:
        os.close(fd)


_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23   # Linux 5.14


def populate(mapping: mmap.mmap, write: bool) -> None:
    """Fault every page of ``mapping`` in now, not on the hot path: the first touch of a page of a
    memfd costs a page fault (several µs), and a name directory's entries land on random pages."""
    try:
        mapping.madvise(_MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ)
        return
    except (OSError, ValueError):   # an older kernel: touch each page
        pass
    for offset in range(0, len(mapping), mmap.PAGESIZE):
        if write:
            mapping[offset] = mapping[offset]
        else:
            mapping[offset]
