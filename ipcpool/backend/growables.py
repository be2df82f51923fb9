"""The seam between ipcpool and a kind of memory, for growable buffers: the broker's chunks and a
client's mapping of them (re-exported by ``backend.base``, with the rest of the seam)."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from typing import Any

from .stock import ChunkStock


class BrokerGrowable(ABC):
    """A growable buffer's memory in the broker: physical chunks, never moved and never copied."""

    chunks: list[int]   # chunk sizes, in address order
    one_file = False    # True: one FD holds every chunk at its offset (host); else one FD per chunk

    @property
    def size(self) -> int:
        return sum(self.chunks)

    @abstractmethod
    def info(self) -> dict[str, Any]:
        """What a client needs to map it besides the FDs: device, granularity, compression."""

    @abstractmethod
    def grow(self, nbytes: int, stock: ChunkStock | None = None) -> None:
        """Add chunks until the size is at least ``nbytes`` (rounded up to the granularity), those
        of ``stock`` first where they fit."""

    def takes_from(self, stock: ChunkStock) -> bool:
        """May the chunks of ``stock`` (lent to a session ahead, see ``broker.loans``) become this
        buffer's? Only where the backend makes chunks ahead at all."""
        return False

    def add(self, chunks: list[Any]) -> None:
        """Append ``chunks`` (lent ones of a stock it ``takes_from``) as they are."""
        raise NotImplementedError

    @abstractmethod
    def fds(self, first: int) -> list[int]:
        """The FDs of chunks ``first`` onwards, or the one file's (owned here; sent as-is)."""

    @abstractmethod
    def close(self) -> None:
        """Release the memory. Called once every client has unmapped it (their mappings would keep
        the physical memory alive anyway: the driver and the kernel count references)."""


class ClientGrowable(ABC):
    """A client's mapping of a growable buffer: one contiguous address range of every chunk."""

    ptr: int
    size: int
    reserved: int   # bytes of address space reserved at ``ptr`` (room to grow in place)
    # True: ``follow`` sees every grow the broker has answered, from what this process holds (the
    # host's memfd), so a sync needs no request. False: a sync asks the broker (CUDA).
    follows = False

    @abstractmethod
    def extend(self, chunks: list[int], fds: list[int]) -> bool:
        """Map ``chunks`` (sizes, in order, after those mapped) from ``fds`` (owned; closed here).
        Returns True when the range moved: every chunk was remapped at a new ``ptr``. The old
        range stays mapped until ``close`` (work still in flight on it stays valid)."""

    def matches(self, info: dict[str, Any]) -> bool:
        """Is this (prepared, empty) mapping the one ``info`` asks for?"""
        return False

    def map_ahead(self, handles: list[tuple[Any, int]]) -> Any:
        """Map imported chunks (``(handle, size)``, see ``ClientBackend.import_loaned``) after
        those mapped, in place, before the broker has said they are the buffer's: a token for
        ``keep`` (they are, and the mapping owns the handles now) or ``drop`` (they are not: the
        caller keeps them). None where they cannot be mapped in place; ``keep`` then maps them."""
        return None

    def on_device(self) -> AbstractContextManager:
        """Its device current for what comes inside (the loan's imports, ``map_ahead``): once for
        them all. Nothing to switch by default."""
        return contextlib.nullcontext()

    def keep(self, handles: list[tuple[Any, int]], token: Any) -> bool:
        """The chunks ``map_ahead`` mapped (token) or not (None) are the buffer's next ones;
        True when the range moved (as ``extend``)."""
        raise NotImplementedError

    def drop(self, token: Any) -> None:
        """Unmap what ``map_ahead`` mapped (the broker grew the buffer with other chunks)."""

    def follow(self, size: int) -> bool | None:
        """Map at least ``size`` bytes from what this process already holds, without asking the
        broker (more where more is there already); True when the range moved (as ``extend``).
        None where it cannot: the new memory's FDs must come from the broker (CUDA: each chunk is
        an FD of its own, so following a grow stays a round trip there)."""
        return None

    def view(self) -> memoryview | None:
        """The bytes, where the CPU can address them (host memory)."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Unmap everything (after the caller's work on it finished) and release the imports."""
