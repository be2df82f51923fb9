"""Host memory: memfd pools and growables, for machines without a GPU (and for CI)."""

from __future__ import annotations

from .broker import HostBrokerBackend
from .client import HostClientBackend, HostMemory
from .pool import HostPool

__all__ = ["HostBrokerBackend", "HostClientBackend", "HostMemory", "HostPool"]
