"""`ipcpool doctor`: which backend the broker would choose here and why, what the GPU can do,
whether CUDA MPS serves it, and whether a broker answers. One plain dict, printed as JSON or as
lines by the CLI."""

from __future__ import annotations

from typing import Any

from .. import backend as backends
from ..backend.mps import MPS_NOTE, mps_status  # noqa: F401 (part of what doctor reports)
from .._version import __version__
from ..errors import IpcPoolError

BROKER_TIMEOUT = 2.0   # seconds a broker has to answer before doctor says none does


def broker_status(socket_dir: str | None) -> dict[str, Any]:
    """Whether a broker answers at ``socket_dir`` (default: where a client would look), and which."""
    from .. import paths
    from .._client.client import connect

    out: dict[str, Any] = {"socket_dir": str(socket_dir) if socket_dir else None, "answers": False}
    try:
        out["socket_dir"] = str(paths.resolve(socket_dir))
        with connect(socket_dir, timeout=BROKER_TIMEOUT) as client:
            s = client.stats()
        out.update(answers=True, **{k: s[k] for k in ("version", "pid", "backend", "uptime", "sessions")})
    except IpcPoolError as exc:
        out["error"] = " ".join(str(exc).split())
    return out


def report(requested: str | None, socket_dir: str | None = None) -> tuple[dict[str, Any], bool]:
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
            from ..backend.cuda import capabilities

            out["capabilities"] = capabilities()
        except Exception as exc:   # a report, not a crash: say what failed
            out["capabilities_error"] = f"{type(exc).__name__}: {exc}"
    out["mps"] = mps_status(ok)
    out["broker"] = broker_status(socket_dir)
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
    b = rep["broker"]
    if b["answers"]:
        out.append(f"broker: answers at {b['socket_dir']} (ipcpool {b['version']}, pid {b['pid']}, "
                   f"backend {b['backend']}, {b['sessions']} session(s))")
    else:
        out.append(f"broker: none answers at {b['socket_dir'] or 'the default socket directory'} ({b['error']})")
    return out
