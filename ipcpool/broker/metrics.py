"""Prometheus metrics of the broker, served over HTTP by prometheus-client.

The event loop writes every value (gauges refreshed about once a second, counters and the latency
histogram as requests are handled); the HTTP thread only reads them, so no backend call ever runs
off the loop's thread. Besides ipcpool's own series: the process collector's (open FDs, resident
memory, CPU) and ``ipcpool_build_info``. No ``_created`` series (a scrape has no use for them), and
a uid's or a pool's series go once it holds nothing, so the label set does not only grow.
"""

from __future__ import annotations

import logging
import time

import platform

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)

from .._version import __version__
from ..errors import IpcPoolError

log = logging.getLogger(__name__)

REFRESH_S = 1.0
# ipcpool_pool_bytes{kind}: the pool's own figures, then what arenas, growable buffers and the
# growth stock hold of it, and its max_size (0: the device's memory bounds it).
POOL_KINDS = ("reserved", "used", "reserved_high", "used_high")
PART_KINDS = ("arena_bytes", "arena_free", "growable_bytes", "stock_bytes", "lent_bytes")


def parse_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


class Metrics:
    def __init__(self, address: str):
        disable_created_metrics()   # (process-wide: the broker's process has no other registry)
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        self.build_info = Gauge("ipcpool_build_info", "Always 1: the broker's version, backend and Python",
                                ["version", "backend", "python"], registry=r)
        self.pool_bytes = Gauge("ipcpool_pool_bytes", "Pool memory, by pool and kind",
                                ["pool", "kind"], registry=r)
        self.uid_bytes = Gauge("ipcpool_uid_bytes", "Bytes held, by uid", ["uid"], registry=r)
        self.growables = Gauge("ipcpool_growables", "Growable buffers, by pool", ["pool"], registry=r)
        self.arenas = Gauge("ipcpool_arenas", "Arenas clients carve objects from, by pool", ["pool"], registry=r)
        self.sessions = Gauge("ipcpool_sessions", "Open client sessions", registry=r)
        self.objects = Gauge("ipcpool_objects", "Named objects, by state", ["state"], registry=r)
        self.requests = Histogram("ipcpool_request_seconds", "Time to handle a request, by op", ["op"],
                                  buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 1.0),
                                  registry=r)
        self.errors = Counter("ipcpool_errors", "Requests refused, by error kind", ["kind"], registry=r)
        host, port = parse_address(address)
        try:
            self.server, self._thread = start_http_server(port, host, registry=r)
        except OSError as exc:
            raise IpcPoolError(f"metrics_address {address}: cannot listen ({exc.strerror})") from exc
        self.address = f"{host}:{self.server.server_port}"
        self._next = 0.0
        self._uids: set[str] = set()    # labels set last time: those gone since are removed
        self._pools: set[str] = set()
        self._built = False
        log.info("metrics on http://%s/metrics", self.address)

    def observe(self, op: str, seconds: float) -> None:
        self.requests.labels(op).observe(seconds)

    def error(self, exc: BaseException) -> None:
        self.errors.labels(type(exc).__name__).inc()

    def refresh(self, broker, force: bool = False) -> None:
        """Gauges from the broker's state, at most once per REFRESH_S (called from the loop)."""
        now = time.monotonic()
        if not force and now < self._next:
            return
        self._next = now + REFRESH_S
        if not self._built:   # (the backend is known once the broker runs)
            self._built = True
            self.build_info.labels(__version__, broker.choice.name, platform.python_version()).set(1)
        reg = broker.registry
        arenas = broker.handoffs.stats()
        growables = broker.growables.stats()
        counts: dict[str, int] = {}
        for arena in broker.handoffs.arenas.values():
            counts[arena.alloc.pool.spec.name] = counts.get(arena.alloc.pool.spec.name, 0) + 1
        pools = reg.stats()
        for name, stats in pools.items():
            parts = {**arenas.get(name, {}), **growables.get(name, {})}
            for kind in POOL_KINDS:
                self.pool_bytes.labels(name, kind).set(stats[kind])
            for kind in PART_KINDS:
                self.pool_bytes.labels(name, kind).set(parts.get(kind, 0))
            self.pool_bytes.labels(name, "max_size").set(reg.pools[name].usage.byte_limit)
            self.growables.labels(name).set(parts.get("growables", 0))
            self.arenas.labels(name).set(counts.get(name, 0))
        for name in self._pools - set(pools):   # a restored generation released
            for kind in (*POOL_KINDS, *PART_KINDS, "max_size"):
                self.pool_bytes.remove(name, kind)
            self.growables.remove(name)
            self.arenas.remove(name)
        self._pools = set(pools)
        uids = {str(uid): held for uid, held in reg.bytes_by_uid.items() if held}
        for uid, held in uids.items():
            self.uid_bytes.labels(uid).set(held)
        for uid in self._uids - set(uids):   # holds nothing now
            self.uid_bytes.remove(uid)
        self._uids = set(uids)
        self.sessions.set(len(broker.sessions))
        states = {"sealed": 0, "writing": 0}
        for obj in broker.objects.objects.values():
            states[obj.state] += 1
        for state, n in states.items():
            self.objects.labels(state).set(n)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
