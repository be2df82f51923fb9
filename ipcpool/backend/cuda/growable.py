"""A growable buffer on the broker: VMM chunks on one device, grown by adding chunks."""

from __future__ import annotations

from typing import Any

from ..base import BrokerGrowable
from . import vmm
from .context import OnDevice
from .limits import VMM_CHUNK


class CudaGrowable(BrokerGrowable):
    """A growable buffer's VMM chunks on one device (see ``vmm``)."""

    def __init__(self, device: int, compression: bool, chunks: list[vmm.Chunk] | None = None):
        self.device = device
        with OnDevice(device):
            vmm.check_supported(device)
            # Compression only where the device offers it; what each chunk got is read back.
            self.compression = compression and vmm.compression_supported(device)
            self.gran = vmm.granularity(device, self.compression)
        self._chunks: list[vmm.Chunk] = chunks or []

    @property
    def chunks(self) -> list[int]:
        return [c.size for c in self._chunks]

    def info(self) -> dict[str, Any]:
        got = bool(self._chunks) and all(c.compression for c in self._chunks)
        return {"device": self.device, "granularity": self.gran, "compression": got}

    def grow(self, nbytes: int) -> None:
        if nbytes <= self.size:
            return
        with OnDevice(self.device):
            sizes = vmm.split(nbytes - self.size, self.gran, VMM_CHUNK)
            self._chunks += vmm.create_chunks(self.device, sizes, self.compression)

    def fds(self, first: int) -> list[int]:
        return [c.fd for c in self._chunks[first:]]

    def close(self) -> None:
        with OnDevice(self.device):
            for c in self._chunks:
                c.close()
        self._chunks = []
