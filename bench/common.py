"""Shared pieces of the benchmarks: a broker in a subprocess, percentiles, the machine, output."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


@contextlib.contextmanager
def broker(backend: str, config_text: str | None = None, runner: tuple[str, ...] = (sys.executable, "-m", "ipcpool"),
           stop: int = signal.SIGTERM, env: dict[str, str] | None = None):
    """Yield the socket dir of a fresh broker; stop it afterwards (``stop``: the signal; both
    end it cleanly). ``runner``: what runs ipcpool's command line (under cProfile, say); ``env``:
    variables set for it (a trace callback's, ``ipcpool.trace``)."""
    import ipcpool

    with tempfile.TemporaryDirectory(prefix="ipcpool-bench-") as tmp:
        args = [*runner, "--log-level", "WARNING", "broker", "--socket-dir", f"{tmp}/s", "--backend", backend]
        if config_text:
            Path(tmp, "b.toml").write_text(config_text)
            args += ["--config", f"{tmp}/b.toml"]
        proc = subprocess.Popen(args, env={**os.environ, **(env or {})})
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
            proc.send_signal(stop)
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


def gpu_device() -> dict:
    """The GPU, driver and CUDA library versions a GPU result was measured with."""
    import cuda.core
    from cuda.bindings import driver as cu
    from cuda.core import Device

    version = cu.cuDriverGetVersion()[1]
    smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip().splitlines()
    return {"device": Device(0).name, "cuda_driver_api": f"{version // 1000}.{version % 1000 // 10}",
            "driver": smi[0] if smi else None, "cuda_core": cuda.core.__version__}


def write_json(name: str, data: dict, out_dir: Path = RESULTS) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def save(name: str, data: dict, plot, out_dir: Path = RESULTS) -> Path:
    """``name``.json and, drawn by ``plot(data, path)``, ``name``.png beside it (a machine
    without matplotlib still gets the JSON)."""
    path = write_json(name, data, out_dir)
    try:
        plot(data, Path(out_dir) / f"{name}.png")
    except ImportError as exc:
        progress(f"no plot: {exc}")
    return path


def paired_bars(path: Path, labels: list[str], series: dict[str, list[float]], title: str, unit: str,
                across: bool = False) -> None:
    """Two series side by side per label (``across``: horizontal bars, for long labels), saved to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    at = range(len(labels))
    fig, ax = plt.subplots(figsize=(7, 3.2 if across else 4))
    for k, (name, values) in enumerate(series.items()):
        side = (-0.2 if k == 0 else 0.2) * (-1 if across else 1)   # the first series left, or on top
        (ax.barh if across else ax.bar)([i + side for i in at], values, 0.4, label=name)
    (ax.set_yticks if across else ax.set_xticks)(list(at), labels)
    (ax.set_xlabel if across else ax.set_ylabel)(unit)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120 if across else 100)


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def gpu_model(name: str) -> str:
    """A GPU's model for file names: "h100" of "NVIDIA H100 80GB HBM3" (its last word is "HBM3")."""
    import re

    found = re.search(r"\b[A-Z]{1,2}\d{2,4}\b", name)
    return (found.group(0) if found else name.split()[-1]).lower()
