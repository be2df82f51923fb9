"""CUDA virtual memory: physical chunks shared as POSIX FDs, mapped into reserved address ranges.

Broker side, a ``Chunk`` is one ``cuMemCreate`` allocation (pinned device memory, POSIX-FD handle
type, compressible where asked and offered) and its exported FD, kept for clients and systemd's FD
store. Client side, a ``Mapping`` imports chunk FDs and maps them one after another into address
space it reserved, granting read-write access to its device and the peers it was given (one
``cuMemSetAccess`` per batch of chunks, over the batch's whole range: the driver asks for a fully
mapped range of whole allocations, not for one allocation). Growth maps new chunks right after the
current ones: inside the reservation (a growable's first one spans its device's memory where the
driver grants that: growth then stays there), or in a range reserved right after it where that is free
(the fast path); otherwise, or where the driver refuses to map a chunk across the end of one
reservation into the next, every chunk is mapped again at a new, larger range (the slow path). The
old range stays mapped until ``close``, so work in flight on the old pointer stays valid; the data
is never copied. The driver counts references: a chunk's memory lives until every process that
imported or created it has unmapped and released it.

cuda.core's VirtualMemoryResource grows buffers in one process but cannot export or import chunks,
so this is cuda.bindings throughout.
"""

from __future__ import annotations

import functools
import os
from contextlib import ExitStack
from typing import Any

from cuda.bindings import driver as cu

from ...errors import BackendUnavailable, InvalidRequest, IpcPoolError
from ...sizes import round_up
from ...fds import OwnedFd
from .driver import access_descs
from .errors import check

POSIX_FD = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_GENERIC = cu.CUmemAllocationCompType.CU_MEM_ALLOCATION_COMP_GENERIC
_ATTR = cu.CUdevice_attribute


def _prop(device: int, compression: bool) -> Any:
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    prop.requestedHandleTypes = POSIX_FD
    if compression:
        prop.allocFlags.compressionType = _GENERIC
    return prop


@functools.cache   # a device's attributes never change: asked once per process, not per buffer
def device_attr(device: int, attr: Any) -> int:
    return int(check(cu.cuDeviceGetAttribute(attr, device), f"cuDeviceGetAttribute({attr.name})"))


def check_supported(device: int) -> None:
    if not device_attr(device, _ATTR.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED):
        raise BackendUnavailable(f"CUDA device {device} has no virtual memory management")
    if not device_attr(device, _ATTR.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED):
        raise BackendUnavailable(f"CUDA device {device} cannot share VMM memory as POSIX FDs")


def compression_supported(device: int) -> bool:
    return bool(device_attr(device, _ATTR.CU_DEVICE_ATTRIBUTE_GENERIC_COMPRESSION_SUPPORTED))


@functools.cache
def granularity(device: int, compression: bool = False) -> int:
    """The recommended granularity: chunk sizes and mapping offsets are multiples of it."""
    flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    return int(check(cu.cuMemGetAllocationGranularity(_prop(device, compression), flag), "cuMemGetAllocationGranularity"))


class Chunk:
    """One physical allocation of the broker's, with its FD (owned here)."""

    __slots__ = ("compression", "fd", "handle", "size")

    def __init__(self, device: int, size: int, compression: bool):
        self.handle = check(cu.cuMemCreate(size, _prop(device, compression), 0), f"cuMemCreate({size})")
        with ExitStack() as undo:   # a failure below releases the allocation and closes its FD
            undo.callback(cu.cuMemRelease, self.handle)
            exported = check(cu.cuMemExportToShareableHandle(self.handle, POSIX_FD, 0), "cuMemExportToShareableHandle")
            owned = undo.enter_context(OwnedFd(int(exported)))
            self._read_compression()
            self.fd = owned.take()
            undo.pop_all()
        self.size = size

    @classmethod
    def restore(cls, fd: int, size: int) -> Chunk:
        """A chunk from an FD a previous broker stored (takes ownership of ``fd``)."""
        self = cls.__new__(cls)
        with ExitStack() as undo:   # a failure below closes the FD, and releases the import
            owned = undo.enter_context(OwnedFd(fd))
            self.handle = check(cu.cuMemImportFromShareableHandle(fd, POSIX_FD), "cuMemImportFromShareableHandle")
            undo.callback(cu.cuMemRelease, self.handle)
            self._read_compression()
            self.fd, self.size = owned.take(), size
            undo.pop_all()
        return self

    def _read_compression(self) -> None:
        got = check(cu.cuMemGetAllocationPropertiesFromHandle(self.handle), "cuMemGetAllocationPropertiesFromHandle")
        # Compression may be refused for lack of resources without an error: read it back.
        self.compression = int(got.allocFlags.compressionType) == int(_GENERIC)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)   # an open FD alone keeps the memory (a dma-buf reference)
            self.fd = -1
            check(cu.cuMemRelease(self.handle), "cuMemRelease")


def create_chunks(device: int, sizes: list[int], compression: bool) -> list[Chunk]:
    """All of ``sizes`` made, or (a failure part way) none: those made are released again."""
    chunks: list[Chunk] = []
    with ExitStack() as made:
        for size in sizes:
            chunk = Chunk(device, size, compression)
            made.callback(chunk.close)
            chunks.append(chunk)
        made.pop_all()   # all made: the caller's now
    return chunks


def restore_chunks(fds: list[int], sizes: list[int]) -> list[Chunk]:
    """Chunks a previous broker stored (takes ownership of every FD, also on failure)."""
    with ExitStack() as owned:
        held = [owned.enter_context(OwnedFd(fd)) for fd in fds]   # closed unless a chunk takes it
        if len(fds) != len(sizes):
            raise InvalidRequest(f"{len(sizes)} stored chunks but {len(fds)} FDs")
        chunks: list[Chunk] = []
        for one, size in zip(held, sizes):
            chunk = Chunk.restore(one.take(), size)   # (closes the FD itself if it fails)
            owned.callback(chunk.close)
            chunks.append(chunk)
        owned.pop_all()   # every chunk restored: the caller's now
    return chunks


def split(nbytes: int, gran: int, most: int) -> list[int]:
    """Chunk sizes covering ``nbytes``: each a multiple of ``gran``, at most ``most``."""
    total = round_up(nbytes, gran)
    most = max(gran, most // gran * gran)
    return [most] * (total // most) + ([total % most] if total % most else [])


def import_handle(fd: int) -> Any:
    """A chunk's handle in this process, from its FD (which the caller still owns)."""
    return check(cu.cuMemImportFromShareableHandle(fd, POSIX_FD), "cuMemImportFromShareableHandle")


def release_handle(handle: Any) -> None:
    check(cu.cuMemRelease(handle), "cuMemRelease")


class Mapping:
    """A client's contiguous mapping of chunks (imported from FDs) on one device, which ``peers``
    (devices the caller has checked can access it: cuDeviceCanAccessPeer) may access too."""

    def __init__(self, device: int, gran: int, headroom: int = 1, peers: tuple[int, ...] = (), span: int = 0):
        self.device = device
        self.access = [device] + [p for p in dict.fromkeys(peers) if p != device]
        self._descs = access_descs(self.access)
        self.gran = gran
        self.headroom = headroom    # reserve this many times the size: room to grow in place
        self.span = span            # and at least this much (see _reserve)
        self.ptr = 0
        self.size = 0
        self.reserved = 0
        self._handles: list[tuple[Any, int]] = []       # (imported handle, size), in order
        self._ranges: list[tuple[int, int]] = []        # reservations (address, length)
        self._mapped: list[tuple[int, int]] = []        # mapped spans (address, length)

    def extend(self, sizes: list[int], fds: list[int]) -> bool:
        """Import and map chunks after those mapped; True when the range moved (see module doc)."""
        new: list[tuple[Any, int]] = []
        try:
            if len(sizes) != len(fds) or any(s <= 0 or s % self.gran for s in sizes):
                raise InvalidRequest("chunk sizes must be positive multiples of the granularity, one per FD")
            for fd, size in zip(fds, sizes):
                new.append((import_handle(fd), size))
        except BaseException:
            for handle, _ in new:
                cu.cuMemRelease(handle)
            raise
        finally:
            for fd in fds:
                os.close(fd)   # the imported handle holds the memory
        try:
            return self._place(new)
        except BaseException:
            for handle, _ in new:   # nothing of theirs stays mapped (see _map)
                cu.cuMemRelease(handle)
            raise

    def reserve_ahead(self) -> None:
        """Reserve the range before any chunk comes (see ``_reserve``): the first map in place."""
        if not self.ptr:
            self.ptr, self.reserved = self._reserve(self.gran)
            self._ranges.append((self.ptr, self.reserved))

    def map_ahead(self, new: list[tuple[Any, int]]) -> list[tuple[int, int]] | None:
        """Map imported chunks after those mapped, in place, not yet counted as the mapping's: the
        spans for ``keep`` or ``drop``. None where they do not fit the reservation, or the driver
        refused (nothing of theirs stays mapped then)."""
        total = self.size + sum(s for _, s in new)
        if not self.ptr or total > self.reserved:
            return None
        try:
            return self._map(self.ptr + self.size, new)
        except IpcPoolError:
            return None

    def keep(self, new: list[tuple[Any, int]], spans: list[tuple[int, int]] | None) -> bool:
        """Imported chunks ``new`` are the next ones (owned here from now on): as ``map_ahead``
        mapped them (``spans``), or mapped now where it did not (None); True when the range moved."""
        if spans is None:
            return self._place(new)
        self._mapped += spans
        self._handles += new
        self.size += sum(s for _, s in new)
        return False

    @staticmethod
    def drop(spans: list[tuple[int, int]] | None) -> None:
        """Unmap what ``map_ahead`` mapped (its handles stay the caller's)."""
        for span in spans or ():
            cu.cuMemUnmap(*span)

    def _place(self, new: list[tuple[Any, int]]) -> bool:
        total = self.size + sum(s for _, s in new)
        if total <= self.reserved or self._reserve_after(total):
            try:
                self._mapped += self._map(self.ptr + self.size, new)
            except IpcPoolError:
                # A chunk may straddle the end of one reservation and the start of the next:
                # where the driver refuses that, map everything at a new range instead.
                if not self._straddles(new):
                    raise
            else:
                self._handles += new
                self.size = total
                return False
        # Slow path: a new range; map every chunk there (the old range stays until close).
        base, length = self._reserve(total)
        self._ranges.append((base, length))
        self._mapped += self._map(base, self._handles + new)   # one access call for the whole range
        moved = bool(self.ptr)
        self.ptr, self.reserved = base, length
        self._handles += new
        self.size = total
        return moved

    def _reserve(self, total: int) -> tuple[int, int]:
        """A new range for ``total`` bytes and room to grow: ``span`` bytes where the driver grants
        that much address space (a growable asks for its device's memory, so that it never moves
        and never reserves again), else ``headroom`` times ``total``."""
        length = round_up(total * self.headroom, self.gran)
        if self.span > length:
            span = round_up(self.span, self.gran)
            err, base = cu.cuMemAddressReserve(span, self.gran, 0, 0)
            if err == cu.CUresult.CUDA_SUCCESS:
                return int(base), span
        return int(check(cu.cuMemAddressReserve(length, self.gran, 0, 0), "cuMemAddressReserve")), length

    def _straddles(self, new: list[tuple[Any, int]]) -> bool:
        """Would one of ``new``, mapped after the current ones, cross the start of a reservation?"""
        starts = {base for base, _ in self._ranges}
        at = self.ptr + self.size
        for _, size in new:
            if any(at < b < at + size for b in starts):
                return True
            at += size
        return False

    def _reserve_after(self, total: int) -> bool:
        """The fast path: reserve the range right after ours (True if the driver gave exactly it)."""
        if not self.ptr:
            return False
        want = self.ptr + self.reserved
        length = round_up(total * self.headroom, self.gran) - self.reserved
        err, got = cu.cuMemAddressReserve(length, 0, want, 0)
        if err != cu.CUresult.CUDA_SUCCESS:
            return False
        if int(got) != want:   # only a hint: somewhere else is no use
            check(cu.cuMemAddressFree(got, length), "cuMemAddressFree")
            return False
        self._ranges.append((want, length))
        self.reserved += length
        return True

    def _map(self, at: int, chunks: list[tuple[Any, int]]) -> list[tuple[int, int]]:
        """Map ``chunks`` one after another from ``at`` and grant access to the whole range in one
        call ([start, at) is contiguous and all mapped then); the spans mapped. On failure nothing
        stays mapped."""
        start, done = at, []
        try:
            for handle, size in chunks:
                check(cu.cuMemMap(at, size, 0, handle, 0), "cuMemMap")
                done.append((at, size))
                at += size
            if done:
                check(cu.cuMemSetAccess(start, at - start, self._descs, len(self._descs)), "cuMemSetAccess")
        except BaseException:
            for span in done:
                cu.cuMemUnmap(*span)
            raise
        return done

    def close(self) -> None:
        """Unmap every range and release the imports. The caller has made sure no work on this
        device still uses the memory (cuMemUnmap does not wait for it)."""
        for at, size in self._mapped:
            cu.cuMemUnmap(at, size)
        for base, length in self._ranges:
            cu.cuMemAddressFree(base, length)
        for handle, _ in self._handles:
            cu.cuMemRelease(handle)
        self._mapped, self._ranges, self._handles = [], [], []
        self.ptr = self.size = self.reserved = 0
