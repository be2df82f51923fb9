"""Fixtures that run real brokers and real client processes (spawn), and kill what gets stuck."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SPAWN = mp.get_context("spawn")


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class BrokerProc:
    """A broker in its own process, as `ipcpool broker` runs it."""

    def __init__(self, socket_dir: Path, backend: str, config_text: str | None, log_path: Path,
                 env: dict[str, str] | None = None, launch=subprocess.Popen):
        """``launch(args, env=..., stdout=..., stderr=...)`` starts it (a harness may wrap it)."""
        self.socket_dir = socket_dir
        self.log_path = log_path
        args = [sys.executable, "-m", "ipcpool", "--log-level", "DEBUG", "broker",
                "--socket-dir", str(socket_dir), "--backend", backend]
        if config_text is not None:
            cfg = log_path.with_suffix(".toml")
            cfg.write_text(config_text)
            args += ["--config", str(cfg)]
        self.killed = False   # ended on purpose by the test (kill()): not a crash
        self._log = open(log_path, "wb")
        self.proc = launch(args, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self.pid = self.proc.pid

    def wait_ready(self, timeout: float = 30.0) -> BrokerProc:
        import ipcpool

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with ipcpool.connect(self.socket_dir, timeout=5) as c:
                    c.stats()
                return self
            except ipcpool.BrokerGone:
                time.sleep(0.05)
        raise RuntimeError(f"broker not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> int:
        """End the broker the hard way on purpose (a crash the test stages); returns its status."""
        self.killed = True
        self.proc.send_signal(sig)
        return self.proc.wait(15)

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture
def start_broker(tmp_path_factory):
    """Factory: ``start_broker(backend="host", config_text=None, socket_dir=None)``."""
    started: list[BrokerProc] = []

    def start(backend: str = "host", config_text: str | None = None, socket_dir: Path | None = None,
              wait: bool = True, env: dict[str, str] | None = None) -> BrokerProc:
        base = tmp_path_factory.mktemp("broker")
        b = BrokerProc(socket_dir or base / "sock", backend, config_text, base / "broker.log", env)
        started.append(b)
        try:
            return b.wait_ready() if wait else b
        except RuntimeError:   # it never served: the test gets the reason in this error, not a crash
            b.killed = True
            raise

    yield start
    crashed = []
    for b in started:
        exited_by_itself = b.proc.poll() is not None
        code = b.stop()
        # A broker stopped with SIGTERM exits 0; anything else (an exit of its own with another
        # status, a signal, a hang past SIGTERM) is a crash the test must not hide, unless the test
        # staged it with BrokerProc.kill().
        if code != 0 and not b.killed:
            how = "exited by itself" if exited_by_itself else "did not stop cleanly on SIGTERM"
            crashed.append(f"broker pid {b.pid} {how} with status {code}; its log:\n{b.log()[-4000:]}")
    assert not crashed, "\n".join(crashed)


@pytest.fixture
def broker(start_broker) -> BrokerProc:
    return start_broker()


def run_together(jobs, timeout: float = 120.0) -> list:
    """Run each ``(target, args)`` as ``target(*args, out)`` in its own spawned process, with one
    shared queue ``out``; return one result per process (in completion order). Kills stragglers
    and fails on a non-zero exit."""
    q = SPAWN.Queue()
    procs = [SPAWN.Process(target=target, args=(*args, q)) for target, args in jobs]
    for p in procs:
        p.start()
    results = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < len(procs) and time.monotonic() < deadline:
            try:
                results.append(q.get(timeout=0.2))
            except queue.Empty:   # a child that died before reporting fails the run now
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
    finally:
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
    codes = [p.exitcode for p in procs]
    assert codes == [0] * len(procs), f"child exit codes {codes}; results {results}"
    return results


def run_procs(target, args_list, timeout: float = 120.0) -> list:
    """``run_together`` for one target, once per args."""
    return run_together([(target, args) for args in args_list], timeout)
