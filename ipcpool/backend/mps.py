"""Whether CUDA MPS serves this machine's GPU, and what that means for crash isolation.

Read from the MPS control socket and /proc alone, without CUDA: ``ipcpool doctor`` asks on any
machine, the CUDA backend warns at broker start.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

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


def mps_warnings() -> list[str]:
    """The broker's start-up warning where MPS serves the device (a CUDA broker's only)."""
    if (mps := mps_status(True))["serves_device"]:
        return [f"{mps['note']} (MPS control socket in {mps['pipe_directory']}; see ipcpool doctor)"]
    return []
