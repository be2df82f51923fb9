"""The host broker backend: memfd pools and growables, nothing asynchronous to order."""

from __future__ import annotations

from typing import Any

from ...fds import close_all
from ...errors import InvalidRequest
from ..base import BrokerBackend, BrokerGrowable, BrokerPool, PoolSpec, SessionContext
from ..stock import ChunkStock
from .growable import HostGrowable
from .pool import HostPool


class HostBrokerBackend(BrokerBackend):
    name = "host"
    durable = True

    def create_pool(self, spec: PoolSpec) -> BrokerPool:
        return HostPool(spec)

    def adopt_pool(self, spec: PoolSpec, fd: int, info: dict[str, Any]) -> BrokerPool:
        return HostPool(spec, fd)

    def open_session(self) -> SessionContext:
        return SessionContext()   # no per-session state on the host

    def create_growable(self, spec: PoolSpec, nbytes: int, compression: bool,
                        stock: ChunkStock | None = None) -> BrokerGrowable:
        return HostGrowable(nbytes)   # compression is a GPU property: reported as not obtained

    def adopt_growable(self, spec: PoolSpec, info: dict[str, Any], chunks: list[int], fds: list[int]) -> BrokerGrowable:
        if len(fds) != 1:
            close_all(fds)
            raise InvalidRequest(f"a stored host growable has one memfd, got {len(fds)}")
        return HostGrowable(0, fds[0], chunks)
