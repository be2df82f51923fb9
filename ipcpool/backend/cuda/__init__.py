"""CUDA: stream-ordered IPC memory pools (POSIX FD), pointer export/import, IPC events.

The only part of ipcpool that imports cuda.*; the package exports the backends, the modules
below are its internals, one job each:

- ``context``: which CUDA context is current (set per thread; switched for one call and given back)
- ``errors``: the one map from CUDA failures to ipcpool errors
- ``driver``, ``events``, ``vmm``, ``caps``, ``descriptors``: what cuda.core lacks, through
  cuda.bindings; IPC events and their lifetimes (R4); VMM chunks; capabilities; wire bytes
- broker side: ``broker`` (the backend), ``session`` (streams and credits), ``ordering`` (a
  pool's ordering: seals, credits, done waits, deferred frees), ``pool`` (a pool: allocation,
  arenas, stats), ``slabs``,
  ``allocation`` (the record the broker holds), ``restored`` (pools from systemd's FD store),
  ``growable``, ``limits``
- client side: ``client`` (the backend, streams, done events), ``client_pool`` (imports, R1/R2),
  ``memory`` (an imported allocation)
"""

from __future__ import annotations

from ...errors import BackendUnavailable

try:
    from .broker import CudaBrokerBackend
    from .caps import capabilities
    from .client import CudaClientBackend
    from .limits import IMPORT_LIMIT
    from .memory import CudaMemory
except ImportError as _exc:  # pragma: no cover - depends on the installation (cuda.core's layout too)
    if not (_exc.name or "").startswith("cuda"):
        raise   # a module of ipcpool's own: a bug, not a missing dependency
    raise BackendUnavailable(f"the CUDA backend needs cuda-core and cuda-bindings: {_exc}") from _exc

__all__ = [
    "IMPORT_LIMIT",
    "CudaBrokerBackend",
    "CudaClientBackend",
    "CudaMemory",
    "capabilities",
]
