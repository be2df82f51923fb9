"""Where the broker's sockets live. Resolved at call time (never at import)."""

from __future__ import annotations

import grp
import os
import stat
import tempfile
from pathlib import Path

from .errors import PeerRefused

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
    try:
        if (SYSTEM_DIR / CONTROL_NAME).exists():
            return SYSTEM_DIR
    except PermissionError:
        # The system service runs, and its directory is closed to us: connecting elsewhere would
        # only say "no broker" about the wrong place.
        raise PeerRefused(
            f"permission denied on {SYSTEM_DIR}: the system broker's socket directory is open to its "
            "group only; ask the operator to add this user to that group (`sudo usermod -aG ipcpool "
            "USER`, then log in again), or set IPCPOOL_SOCKET_DIR (or --socket-dir) to reach another broker"
        ) from None
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "ipcpool"
    return Path(tempfile.gettempdir()) / f"ipcpool-{os.getuid()}"


def resolve(socket_dir: str | os.PathLike | None) -> Path:
    return Path(socket_dir) if socket_dir else default_socket_dir()


def why_denied(path: Path) -> str:
    """Why the filesystem keeps this process from ``path`` (a socket or its directory), and
    what to do: the group that would let it through, for a user to be added to."""
    for place in (path.parent, path):
        try:
            st = place.stat()
        except PermissionError:
            continue   # inside a directory we cannot search: that directory is the one
        except OSError:
            break
        need = 0o010 if place == path.parent else 0o060
        if os.getuid() == st.st_uid or st.st_mode & (need >> 3):   # the owner, or open to others
            continue
        try:
            group = grp.getgrgid(st.st_gid).gr_name
        except KeyError:
            group = str(st.st_gid)
        mine = st.st_gid == os.getegid() or st.st_gid in os.getgroups()
        return (f"the filesystem refused: {place} is {stat.filemode(st.st_mode)} of group {group}, "
                + ("which this process is in but may not use; ask the operator to fix its mode"
                   if mine else
                   f"which this process is not in; ask the operator to add this user to group {group} "
                   "(then log in again), or to set socket_group in the broker's config"))
    return (f"the filesystem refused access to {path}; ask the operator to add this user to the "
            "socket directory's group, or to set socket_group in the broker's config")
