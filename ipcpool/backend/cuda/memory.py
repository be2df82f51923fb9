"""One imported allocation in a client: the memory protocol over CUDA memory (zero-copy)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from cuda.core import Buffer, Stream

from ...errors import ClosedError
from ..base import ImportedMemory
from . import driver as drv
from . import vmm
from .context import OnDevice
from .errors import cuda_errors

log = logging.getLogger(__name__)


class StreamSource(Protocol):
    """What memory needs of the client backend (``client.CudaClientBackend``)."""

    def stream(self, obj: Any, device: int) -> Stream:
        """What a caller passed as a stream, as a cuda.core Stream."""


class CudaMemory(ImportedMemory):
    """One imported allocation: a cuda.core Buffer over the broker's memory (zero-copy). For a slab
    range the Buffer is made on first use: a batch of a thousand leases mostly needs only ``ptr``."""

    def __init__(self, buffer: Buffer | None, size: int, device: int, whole: bool = True,
                 mapping: vmm.Mapping | None = None, base: tuple[CudaMemory, int] | None = None):
        self._buffer = buffer
        self._released = False
        self.size = size
        self.device = device
        self.whole = whole   # False: a range of a slab the pool keeps imported
        self.mapping = mapping   # VMM chunks mapped here (memory above the import limit)
        self._slab = base        # a slab range: (the slab, as memory of its own; our offset in it)
        # A range's pointer is taken from its slab when first asked: the slab may still be
        # importing (``PendingSlab``).
        self._ptr = int(buffer.handle) if buffer is not None else None

    @property
    def ptr(self) -> int:
        p = self._ptr
        if p is None:
            slab, offset = self._slab
            p = self._ptr = slab.ptr + offset
        return p

    def ready(self) -> None:
        if self._ptr is None:
            self.ptr   # noqa: B018 (a range waits for its slab)

    def slab(self) -> tuple[CudaMemory, int] | None:
        return self._slab

    @property
    def buffer(self) -> Buffer:
        self._live()
        if self._buffer is None:
            self._buffer = Buffer.from_handle(self.ptr, self.size, owner=self._slab[0].buffer)
        return self._buffer

    @property
    def released(self) -> bool:
        return self._released

    def _live(self) -> None:
        if self._released:
            raise ClosedError("memory was released")

    @property
    def cuda_array_interface(self) -> dict[str, Any]:
        self._live()
        # "stream": None: the stream given at import already waits on the ready event (R1); work
        # on other streams is ordered by the caller, as for any CUDA allocation.
        return {
            "version": 3,
            "shape": (self.size,),
            "typestr": "|u1",
            "data": (self.ptr, False),
            "strides": None,
            "stream": None,
        }

    def dlpack(self, **kwargs: Any) -> Any:
        # Ordering is already in place: the stream given at import waits on the ready/seal event
        # (R1), so the export asks cuda.core for no further synchronisation (-1).
        kwargs["stream"] = -1
        try:
            return self.buffer.__dlpack__(**kwargs)
        except (NotImplementedError, BufferError, ValueError, TypeError) as exc:
            log.debug("Buffer.__dlpack__ refused stream=-1 (%s); exporting without a stream", exc)
            kwargs.pop("stream")
            return self.buffer.__dlpack__(**kwargs)

    def dlpack_device(self) -> tuple[int, int]:
        self._live()
        return (2, self.device)   # kDLCUDA: known, so no pointer query (~20 µs measured) per call

    def copy_from_host(self, src: memoryview, offset: int, backend: StreamSource, stream: Any) -> None:
        """Host bytes into this memory at ``offset``, ordered on ``stream`` (``Buffer.write``)."""
        self._live()
        with OnDevice(self.device):
            s = backend.stream(stream, self.device)
            with cuda_errors("copying host bytes to the GPU"):
                drv.copy_from_host(self.ptr + offset, src, int(s.handle))

    def detach(self) -> Buffer | None:
        """Mark the memory released and hand over its Buffer (None for a slab range): the pool
        frees or unmaps it."""
        if self._released:
            raise ClosedError("memory was already released")
        self._released = True
        buf, self._buffer = self._buffer, None
        return buf


class PendingSlab(CudaMemory):
    """A slab imported on the client backend's worker thread (``CudaClientPool``): its ranges are
    leased and viewed while the next slabs import (the driver calls release the GIL). Its pointer,
    Buffer and mapping wait for the import; a failed one raises there, and the pool forgets it."""

    def __init__(self, future: Future, size: int, device: int, forget: Callable[[], None]):
        super().__init__(None, size, device, whole=False)
        self._future: Future | None = future
        self._forget = forget

    def ready(self) -> None:
        if self._future is None:
            return
        try:
            self._buffer, self.mapping = self._future.result()
        except BaseException:
            self._forget()   # a later lease of the slab imports it again
            raise
        self._ptr = int(self._buffer.handle)
        self._future = None

    @property
    def ptr(self) -> int:
        self.ready()
        return self._ptr

    @property
    def buffer(self) -> Buffer:
        self._live()
        self.ready()
        return self._buffer
