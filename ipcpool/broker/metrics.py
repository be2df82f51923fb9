"""Prometheus metrics of the broker, served over HTTP by prometheus-client.

The event loop writes every value (gauges refreshed about once a second, counters and the latency
histogram as requests are handled); the HTTP thread only reads them, so no backend call ever runs
off the loop's thread.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)

from ..errors import IpcPoolError

log = logging.getLogger(__name__)

REFRESH_S = 1.0


def parse_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


class Metrics:
    def __init__(self, address: str):
        self.registry = r = CollectorRegistry()
        self.pool_bytes = Gauge("ipcpool_pool_bytes", "Pool memory, by pool and kind",
                                ["pool", "kind"], registry=r)
        self.uid_bytes = Gauge("ipcpool_uid_bytes", "Bytes held, by uid", ["uid"], registry=r)
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
        reg = broker.registry
        for name, stats in reg.stats().items():
            for kind in ("reserved", "used", "reserved_high", "used_high"):
                self.pool_bytes.labels(name, kind).set(stats[kind])
        for uid, held in reg.bytes_by_uid.items():
            self.uid_bytes.labels(str(uid)).set(held)
        self.sessions.set(len(broker.sessions))
        states = {"sealed": 0, "writing": 0}
        for obj in broker.objects.objects.values():
            states[obj.state] += 1
        for state, n in states.items():
            self.objects.labels(state).set(n)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
