"""`ipcpool demo`: a producer process writes a pattern into broker memory, a consumer process opens
the same memory zero-copy and verifies it.

Where no broker serves the socket directory, the demo starts a private broker in a temporary
directory of its own (and says so), and stops it at the end. Every failure (the broker does not
start, a process is refused or dies) ends the demo within seconds as one ``DemoFailed`` line.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from .. import paths
from .._client.client import connect
from ..errors import BrokerGone, DemoFailed, IpcPoolError

DEMO_BYTES = 4 << 20
CONNECT_TIMEOUT = 10.0    # a broker that answers nothing within this is a failure, not a wait
BROKER_START = 30.0       # a private broker that is not ready by then is a failure (CUDA: ~1 s)
EXCHANGE = 60.0           # the whole hand-off, spawn included (~1 s on the host backend)


def _pattern(n: int) -> bytes:
    return (hashlib.sha256(b"ipcpool demo").digest() * (n // 32 + 1))[:n]


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if not isinstance(exc, IpcPoolError) else str(exc)


def _producer(socket_dir, to_consumer, from_consumer, results) -> None:
    try:
        with connect(socket_dir, timeout=CONNECT_TIMEOUT) as client:
            with client.allocate(DEMO_BYTES) as buf:
                buf.view[:] = _pattern(DEMO_BYTES)
                to_consumer.put((os.getpid(), client.backend, buf.share()))
                from_consumer.get(timeout=EXCHANGE)   # keep the memory until the consumer checked it
    except BaseException as exc:   # reported to the parent as one line, not a child's traceback
        results.put(("error", "producer", _one_line(exc)))


def _consumer(socket_dir, from_producer, to_producer, results) -> None:
    try:
        pid, backend, token = from_producer.get(timeout=EXCHANGE)
        with connect(socket_dir, timeout=CONNECT_TIMEOUT) as client:
            with client.open(token) as buf:
                ok = bytes(buf.view) == _pattern(DEMO_BYTES)
                results.put(("ok", pid, os.getpid(), backend, buf.size, ok))
        to_producer.put("done")
    except queue.Empty:
        results.put(("error", "consumer", "no token from the producer"))
    except BaseException as exc:
        results.put(("error", "consumer", _one_line(exc)))


class PrivateBroker:
    """``ipcpool broker`` in a temporary socket directory, for the demo alone."""

    def __init__(self, backend: str | None):
        self.root = Path(tempfile.mkdtemp(prefix="ipcpool-demo-"))
        self.socket_dir = self.root / "sock"
        self.log_path = self.root / "broker.log"
        args = [sys.executable, "-m", "ipcpool", "broker", "--socket-dir", str(self.socket_dir),
                "--log-level", "WARNING"]
        if backend:
            args += ["--backend", backend]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

    def _last_line(self) -> str:
        lines = [ln.strip() for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        return lines[-1] if lines else f"exit status {self.proc.returncode}"

    def wait_ready(self, timeout: float = BROKER_START) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise DemoFailed(f"the private broker did not start: {self._last_line()}")
            try:
                with connect(self.socket_dir, timeout=CONNECT_TIMEOUT, arena_bytes=0) as c:
                    return c.stats()
            except BrokerGone:
                if time.monotonic() > deadline:
                    raise DemoFailed(f"the private broker was not ready after {timeout:.0f} s") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)


def _exchange(socket_dir: Path) -> tuple:
    """Run the producer and the consumer; their result, or DemoFailed as soon as either fails."""
    ctx = mp.get_context("spawn")
    to_consumer, to_producer, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = {
        "producer": ctx.Process(target=_producer, args=(str(socket_dir), to_consumer, to_producer, results)),
        "consumer": ctx.Process(target=_consumer, args=(str(socket_dir), to_consumer, to_producer, results)),
    }
    for p in procs.values():
        p.start()
    deadline = time.monotonic() + EXCHANGE
    try:
        while True:
            try:
                got = results.get(timeout=0.1)
            except queue.Empty:
                dead = [f"{role} (exit status {p.exitcode})" for role, p in procs.items()
                        if p.exitcode not in (None, 0)]
                if dead:
                    raise DemoFailed(f"{', '.join(dead)} ended without a result") from None
                if time.monotonic() > deadline:
                    raise DemoFailed(f"no result after {EXCHANGE:.0f} s") from None
                continue
            if got[0] == "error":
                raise DemoFailed(f"{got[1]}: {got[2]}")
            for p in procs.values():
                p.join(10)
            return got[1:]
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
            p.join(5)
        for q in (to_consumer, to_producer, results):
            q.close()
            q.cancel_join_thread()


def run(socket_dir=None, *, backend: str | None = None, private: bool = False,
        say: Callable[[str], None] = print) -> bool:
    """Run the demo against the broker serving ``socket_dir``, or a private one where none does
    (or ``private``). True when the consumer saw every byte; DemoFailed on any failure."""
    socket_dir = paths.resolve(socket_dir)
    broker = None
    if not private:
        try:
            with connect(socket_dir, timeout=CONNECT_TIMEOUT, arena_bytes=0):
                pass
        except BrokerGone:
            say(f"no broker serves {socket_dir}: the demo starts a private one for itself")
            private = True
    try:
        if private:
            broker = PrivateBroker(backend)
            stats = broker.wait_ready()
            say(f"private broker pid {stats['pid']} ready ({stats['backend']} backend, {broker.socket_dir})")
            socket_dir = broker.socket_dir
        producer, consumer, backend_name, size, ok = _exchange(socket_dir)
        say(f"producer pid {producer} wrote a {size >> 20} MiB pattern into broker memory ({backend_name} backend)")
        say(f"consumer pid {consumer} opened the same memory zero-copy and "
            + ("verified every byte: OK" if ok else "found DIFFERENT bytes: FAILED"))
    finally:
        if broker is not None:
            broker.stop()
            say("private broker stopped")
    return ok
