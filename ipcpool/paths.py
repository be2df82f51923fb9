"""Where the broker's sockets live. Resolved at call time (never at import)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

SYSTEM_DIR = Path("/run/ipcpool")
CONTROL_NAME = "broker.sock"
ZMQ_NAME = "broker.zmq"
LOCK_NAME = "broker.lock"


def default_socket_dir() -> Path:
    """$IPCPOOL_SOCKET_DIR, else the system service's /run/ipcpool where it exists, else
    $XDG_RUNTIME_DIR/ipcpool, else a per-user directory under the temp dir (never shared)."""
    env = os.environ.get("IPCPOOL_SOCKET_DIR")
    if env:
        return Path(env)
    if (SYSTEM_DIR / CONTROL_NAME).exists():
        return SYSTEM_DIR
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "ipcpool"
    return Path(tempfile.gettempdir()) / f"ipcpool-{os.getuid()}"


def resolve(socket_dir: str | os.PathLike | None) -> Path:
    return Path(socket_dir) if socket_dir else default_socket_dir()
