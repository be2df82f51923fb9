"""`ipcpool doctor`: which backend the broker would choose here and why, what the GPU can do, and
whether CUDA MPS serves it. One plain dict, printed as JSON or as lines by the CLI."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from . import backend as backends
from ._version import __version__
from .errors import IpcPoolError

MPS_DEFAULT_PIPE = "/tmp/nvidia-mps"


def _running(names: set[str]) -> dict[str, list[int]]:
    """Pids of the processes (any user's, as far as /proc shows them) whose name is in ``names``."""
    found: dict[str, list[int]] = {n: [] for n in names}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            comm = Path(entry.path, "comm").read_text().strip()
        except OSError:
            continue
        if comm in found:
            found[comm].append(int(entry.name))
    return found


# What MPS means for ipcpool, said by `ipcpool doctor` and by the broker when it starts under MPS.
MPS_NOTE = (
    "every CUDA process here (the broker and each worker) is a client of one MPS server, so a "
    "crash is not isolated to its process: a client killed with GPU work in flight can put the "
    "MPS server, and every process on the GPU, in a failed state (e.g. CUDA_ERROR_ILLEGAL_ADDRESS; "
    "new processes then cannot initialise CUDA). ipcpool still takes back a killed client's memory "
    "in the broker's bookkeeping, but the GPU may need the MPS server restarted (echo quit | "
    "nvidia-cuda-mps-control, start the daemon again), and the broker and its workers with it"
)


def mps_status(cuda_usable: bool) -> dict[str, Any]:
    """Whether an MPS control daemon serves CUDA clients of this machine: its pipe directory
    ($CUDA_MPS_PIPE_DIRECTORY, else /tmp/nvidia-mps) holds a ``control`` socket, and its process
    runs. A CUDA process started now (the broker, a worker) then runs under MPS.
    ``crash_isolation`` is "per-process" without MPS (a killed client harms no other process on
    the GPU) and "shared" under it, where ``note`` says what that means."""
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_DEFAULT_PIPE)
    procs = _running({"nvidia-cuda-mps-control", "nvidia-cuda-mps-server"})
    control = (pipe / "control").exists()
    serves = bool(cuda_usable and control)
    return {
        "pipe_directory": str(pipe),
        "control_socket": control,
        "control_daemon_pids": procs["nvidia-cuda-mps-control"],
        "server_pids": procs["nvidia-cuda-mps-server"],
        "serves_device": serves,
        "crash_isolation": "shared" if serves else "per-process",
        "note": f"MPS serves the device: {MPS_NOTE}" if serves else None,
    }


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
