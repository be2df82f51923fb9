"""A growable buffer on the broker: VMM chunks on one device, grown by adding chunks: those of the
pool's stock first (made ahead, see ``backend.stock``), then new ones for what the stock lacks.
Each chunk is an FD of its own, so a client follows a grow with a request for the new chunks' FDs.
Its info names the pool's peer devices (``peer_access``, checked when the pool was made): a client
grants them access to its mapping, as it does on an imported pool."""

from __future__ import annotations

import functools
from typing import Any

from ..base import BrokerGrowable
from ..stock import ChunkStock
from . import vmm
from .context import OnDevice
from .limits import VMM_CHUNK


@functools.cache   # per device and ask: (compression granted, granularity), never changing
def _caps(device: int, compression: bool) -> tuple[bool, int]:
    with OnDevice(device):
        vmm.check_supported(device)
        # Compression only where the device offers it; what each chunk got is read back.
        granted = compression and vmm.compression_supported(device)
        return granted, vmm.granularity(device, granted)


class CudaGrowable(BrokerGrowable):
    """A growable buffer's VMM chunks on one device (see ``vmm``)."""

    size = 0   # kept as chunks come (the base class sums them at every read)

    def __init__(self, device: int, compression: bool, chunks: list[vmm.Chunk] | None = None,
                 peers: tuple[int, ...] = ()):
        self.device = device
        self.peers = tuple(sorted({p for p in peers if p != device}))
        self.compression, self.gran = _caps(device, compression)
        self._chunks: list[vmm.Chunk] = []
        # Sizes and total kept as chunks come: every request reads them, several times.
        self.chunks: list[int] = []
        self._append(chunks or [])

    def _append(self, chunks: list[vmm.Chunk]) -> None:
        self._chunks += chunks
        self.chunks += [c.size for c in chunks]
        self.size = sum(self.chunks)

    def info(self) -> dict[str, Any]:
        got = bool(self._chunks) and all(c.compression for c in self._chunks)
        return {"device": self.device, "granularity": self.gran, "compression": got, "peer_access": list(self.peers)}

    def grow(self, nbytes: int, stock: ChunkStock | None = None) -> None:
        if nbytes <= self.size:
            return
        need, taken = nbytes - self.size, []
        if stock is not None and self.takes_from(stock):
            taken, need = stock.take(need)
        try:
            made = []
            if need > 0:   # (the stock had it all: no context switch)
                with OnDevice(self.device):
                    made = vmm.create_chunks(self.device, vmm.split(need, self.gran, VMM_CHUNK), self.compression)
        except BaseException:
            if taken:
                stock.give_back(taken)
            raise
        self._append(taken + made)

    def takes_from(self, stock: ChunkStock) -> bool:
        # The stock's chunks are of this device's plain granularity and never compressible.
        return not self.compression and stock.gran == self.gran

    def add(self, chunks: list[vmm.Chunk]) -> None:
        self._append(chunks)

    def fds(self, first: int) -> list[int]:
        return [c.fd for c in self._chunks[first:]]

    def close(self) -> None:
        with OnDevice(self.device):
            for c in self._chunks:
                c.close()
        self._chunks, self.chunks, self.size = [], [], 0
