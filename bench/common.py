"""Shared pieces of the benchmarks: a broker in a subprocess, percentiles, the machine, output."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


@contextlib.contextmanager
def broker(backend: str, config_text: str | None = None):
    """Yield the socket dir of a fresh broker; stop it afterwards."""
    import ipcpool

    with tempfile.TemporaryDirectory(prefix="ipcpool-bench-") as tmp:
        args = [sys.executable, "-m", "ipcpool", "--log-level", "WARNING", "broker",
                "--socket-dir", f"{tmp}/s", "--backend", backend]
        if config_text:
            Path(tmp, "b.toml").write_text(config_text)
            args += ["--config", f"{tmp}/b.toml"]
        proc = subprocess.Popen(args)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    with ipcpool.connect(f"{tmp}/s"):
                        break
                except ipcpool.BrokerGone:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            yield Path(tmp) / "s"
        finally:
            proc.terminate()
            proc.wait(30)


def percentiles(samples_ns: list[int]) -> dict[str, float]:
    s = sorted(samples_ns)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))] / 1000.0  # noqa: E731
    return {"p50_us": pick(0.50), "p99_us": pick(0.99), "mean_us": sum(s) / len(s) / 1000.0, "n": len(s)}


def machine() -> dict:
    info = {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    return info


def write_json(name: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
