"""A broker in its own process, as `ipcpool broker` runs it (the conftest's fixtures start these)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


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
        code = terminate(self.proc, timeout)
        self._log.close()
        return code


def terminate(proc: subprocess.Popen, timeout: float = 15.0) -> int:
    """SIGTERM, then SIGKILL after ``timeout`` seconds; the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
