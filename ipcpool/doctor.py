"""`ipcpool doctor`: which backend the broker would choose here and why, what the GPU can do, and
whether CUDA MPS serves it. One plain dict, printed as JSON or as lines by the CLI."""

from __future__ import annotations

from typing import Any

from . import backend as backends
from .backend.mps import MPS_NOTE, mps_status  # noqa: F401 (part of what doctor reports)
from ._version import __version__
from .errors import IpcPoolError

def report(requested: str | None) -> tuple[dict[str, Any], bool]:
    """(the report, whether the requested backend can run here)."""
    ok, why = backends.probe_cuda()
    out: dict[str, Any] = {"version": __version__, "backend": None, "reason": None,
                           "cuda": {"usable": ok, "why": why}, "capabilities": None}
    usable = True
    try:
        choice = backends.choose(requested)
        out["backend"], out["reason"] = choice.name, choice.reason
    except IpcPoolError as exc:
        out["error"] = str(exc)
        usable = False
    if ok:
        try:
            from .backend.cuda import capabilities

            out["capabilities"] = capabilities()
        except Exception as exc:   # a report, not a crash: say what failed
            out["capabilities_error"] = f"{type(exc).__name__}: {exc}"
    out["mps"] = mps_status(ok)
    return out, usable


def lines(rep: dict[str, Any]) -> list[str]:
    """The report as lines for a terminal."""
    cuda = rep["cuda"]
    out = [f"CUDA: {'usable' if cuda['usable'] else 'not usable'} ({cuda['why']})"]
    if rep["backend"]:
        out.append(f"backend chosen: {rep['backend']} ({rep['reason']})")
    else:
        out.append(f"backend: {rep['error']}")
    mps = rep["mps"]
    if mps["serves_device"]:
        out.append(f"MPS: serves the device (control socket in {mps['pipe_directory']}); "
                   "crash isolation: shared by every process on the GPU")
        out.append(f"  note: {MPS_NOTE}")
    else:
        out.append("MPS: not in use" + ("" if cuda["usable"] else " (no usable GPU)"))
    caps = rep.get("capabilities")
    if caps:
        out.append(f"driver {caps['driver']}, {caps['device_count']} device(s), "
                   f"ipcpool ready: {'yes' if caps['ipcpool_ready'] else 'NO'}")
        for d in caps["devices"]:
            flags = ", ".join(k.removesuffix("_supported") for k, v in d.items() if k.endswith("_supported") and v)
            out.append(f"  GPU {d['ordinal']}: {d['name']}, compute {d['compute_capability']}, "
                       f"{d['total_memory'] >> 20} MiB; {flags}; pool handles: {', '.join(d['mempool_handle_types']) or 'none'}")
        if caps["device_count"] > 1:
            out.append(f"  peer access: {caps['peer_access']}")
    if rep.get("capabilities_error"):
        out.append(f"capabilities: {rep['capabilities_error']}")
    return out
