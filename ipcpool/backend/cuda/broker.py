"""The CUDA broker backend: pools, sessions, and the frees and events they leave behind.

Every session gets its own stream per device (R3): allocations are made on it, a fresh *ready*
IPC event is recorded after each, and frees wait on the client's *done* event on it before they
free (R2). The frees themselves run on the backend's own stream per device (the reaper), once
``sweep`` sees every done event settled. Nothing on these paths blocks the host.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

from cuda.core import Stream

from ...errors import IpcPoolError
from ..base import BrokerBackend, BrokerGrowable, BrokerPool, PoolSpec, SessionContext
from ..mps import mps_warnings
from ..stock import ChunkStock
from . import driver as drv
from . import vmm
from .allocation import Allocation
from .context import OnDevice, make_current
from .errors import is_cuda_error, translate, usable
from .events import CreditStock, Graveyard
from .growable import CudaGrowable
from .limits import VMM_CHUNK
from .ordering import DeferredFrees, SealWatch
from .pool import CudaPool
from .restored import RestoredCudaPool
from .session import CudaSession

log = logging.getLogger(__name__)


class CudaBrokerBackend(BrokerBackend):
    name = "cuda"
    durable = True

    def startup_warnings(self) -> list[str]:
        return mps_warnings()   # under MPS a crash is not isolated to its process

    def foreign_error(self, exc: Exception) -> IpcPoolError | None:
        return translate(exc, "CUDA") if is_cuda_error(exc) else None

    def __init__(self) -> None:
        with usable():
            make_current(0)
        self._reapers: dict[int, Stream] = {}
        self._graveyard = Graveyard()
        self._orphans: list[Graveyard] = []
        self._sessions: weakref.WeakSet[CudaSession] = weakref.WeakSet()
        self._pools: list[CudaPool] = []
        self._frees = DeferredFrees()   # frees waiting on done events
        self._seals = SealWatch()       # seals not seen done
        self.credits = CreditStock()    # events clients record for us, recycled (never destroyed)

    def create_pool(self, spec: PoolSpec) -> BrokerPool:
        pool = CudaPool(self, spec)
        self._pools.append(pool)
        return pool

    def adopt_pool(self, spec: PoolSpec, fd: int, info: dict[str, Any]) -> BrokerPool:
        return RestoredCudaPool(spec, fd, info)

    def create_growable(self, spec: PoolSpec, nbytes: int, compression: bool,
                        stock: ChunkStock | None = None) -> BrokerGrowable:
        g = CudaGrowable(spec.device, compression, peers=spec.peer_access)
        g.grow(nbytes, stock)
        return g

    def chunk_stock(self, spec: PoolSpec, target: int) -> ChunkStock | None:
        device = spec.device
        with OnDevice(device):
            vmm.check_supported(device)
            gran = vmm.granularity(device, False)   # stocked chunks are never compressible

        def make(size: int) -> vmm.Chunk:
            with OnDevice(device):
                return vmm.Chunk(device, size, False)

        def release(chunk: vmm.Chunk) -> None:
            with OnDevice(device):
                chunk.close()

        return ChunkStock(target, gran, make, VMM_CHUNK, release)

    def adopt_growable(self, spec: PoolSpec, info: dict[str, Any], chunks: list[int], fds: list[int]) -> BrokerGrowable:
        with OnDevice(spec.device):
            restored = vmm.restore_chunks(fds, chunks)
        return CudaGrowable(spec.device, bool(info.get("compression")), restored, peers=spec.peer_access)

    def open_session(self) -> SessionContext:
        session = CudaSession(self)
        self._sessions.add(session)
        return session

    # -- what pools and sessions use (see pool.PoolServices, session.FreeSweeper)
    def reaper(self, device: int) -> Stream:
        """The backend's own stream on ``device``: frees run here; it never waits on a client."""
        stream = self._reapers.get(device)
        if stream is None:
            stream = self._reapers[device] = make_current(device).create_stream()
        return stream

    def retire(self, stream: Stream, *events: Any) -> None:
        self._graveyard.bury(stream, *events)

    def keep_graveyard(self, graveyard: Graveyard) -> None:
        self._orphans.append(graveyard)

    def defer_free(self, alloc: Allocation, free_now: Callable[[Allocation], None], owner: str) -> None:
        self._frees.add(alloc, free_now, owner)
        self.sweep()

    def watch_seal(self, alloc: Allocation) -> None:
        self._seals.watch(alloc)

    @property
    def pending_frees(self) -> int:
        return len(self._frees)

    def sweep(self) -> None:
        """Never blocks: run the frees whose importers are done; drop events nobody needs."""
        self._frees.run_ready()
        self._graveyard.sweep()
        if self._orphans:
            for g in self._orphans:
                g.sweep()
            self._orphans = [g for g in self._orphans if len(g)]
        self._seals.confirm()

    def query_streams(self) -> None:
        for session in list(self._sessions):
            for stream in session.streams():
                drv.query_stream(stream)
        for stream in self._reapers.values():
            drv.query_stream(stream)
        self.sweep()

    def close(self) -> None:
        # Every pool is closed by now; what remains is bookkeeping. Never wait on a client here.
        self.sweep()
        for owner in self._frees.owners():
            log.warning("pool %r: a free still waits on a client at shutdown", owner)
        for stream in self._reapers.values():
            stream.sync()
        self._graveyard.drain()
        for stream in self._reapers.values():
            stream.close()
        self._reapers.clear()
        self.credits.close()
