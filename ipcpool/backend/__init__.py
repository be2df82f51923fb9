"""Backend choice: ``auto`` takes CUDA where a driver and a device answer, host memory otherwise.

The probe uses the driver library through ctypes, so choosing (and running) the host backend never
imports cuda.*: a CPU-only worker starts fast and CI needs no driver.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

from ..errors import BackendUnavailable
from .base import BrokerBackend, ClientBackend

BACKENDS = ("auto", "host", "cuda")


@dataclass(frozen=True)
class Choice:
    name: str
    reason: str


def probe_cuda() -> tuple[bool, str]:
    """(usable, why) for the CUDA driver, without importing cuda.*."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False, "no CUDA driver library (libcuda.so.1 not found)"
    if lib.cuInit(0) != 0:
        return False, "the CUDA driver is present but cuInit failed (no usable GPU?)"
    count = ctypes.c_int(0)
    if lib.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return False, "the CUDA driver reports no device"
    version = ctypes.c_int(0)
    lib.cuDriverGetVersion(ctypes.byref(version))
    return True, f"CUDA driver {version.value // 1000}.{version.value % 1000 // 10} with {count.value} device(s)"


def choose(requested: str | None = None) -> Choice:
    """Resolve ``requested`` (else $IPCPOOL_BACKEND, else auto) to a concrete backend name."""
    name = requested or os.environ.get("IPCPOOL_BACKEND") or "auto"
    if name not in BACKENDS:
        raise BackendUnavailable(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "host":
        return Choice("host", "asked for host memory")
    ok, why = probe_cuda()
    if name == "cuda":
        if not ok:
            raise BackendUnavailable(f"backend 'cuda' asked for, but {why}; use --backend host")
        return Choice("cuda", f"asked for CUDA; {why}")
    return Choice("cuda", why) if ok else Choice("host", f"{why}: using host memory")


def broker_backend(name: str) -> BrokerBackend:
    if name == "host":
        from .host import HostBrokerBackend

        return HostBrokerBackend()
    if name == "cuda":
        from .cuda import CudaBrokerBackend

        return CudaBrokerBackend()
    raise BackendUnavailable(f"unknown backend {name!r}")


def client_backend(name: str) -> ClientBackend:
    if name == "host":
        from .host import HostClientBackend

        return HostClientBackend()
    if name == "cuda":
        from .cuda import CudaClientBackend

        return CudaClientBackend()
    raise BackendUnavailable(f"the broker serves backend {name!r}, which this client does not know")
