"""The asymmetric barrier between a reader's hazard slot and the broker's directory entry.

A reader stores its slot, then loads the entry to check it still holds the object; the broker
stores the entry's new state (gone), then loads the slots. On x86 (TSO) a store may pass a later
load, so without a fence each side could miss the other's store: the reader reads freed memory.
``membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED)`` run by the broker between its store and its loads
makes every thread of every registered process pass a full barrier, so readers need none of their
own (the heavy/light barrier pair of liburcu and folly). Clients register at connect; where the
kernel lacks it, the broker falls back to MEMBARRIER_CMD_GLOBAL (every process, slower) and, failing
that, tells clients to take no lease from a directory (they ask the broker, as before).
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading

_SYSCALL = {"x86_64": 324, "aarch64": 283, "arm64": 283}.get(platform.machine())
QUERY, GLOBAL, GLOBAL_EXPEDITED, REGISTER_GLOBAL_EXPEDITED = 0, 1 << 0, 1 << 1, 1 << 2

_libc = None


def _call(cmd: int) -> int:
    global _libc
    if _SYSCALL is None:
        return -1
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc.syscall(_SYSCALL, cmd, 0, 0)


_registered: dict[int, bool] = {}   # pid -> registered (a forked child is a process of its own)
_registering: dict[int, threading.Thread] = {}
# This process is registered: every directory read asks (reading this first: ``registered`` is a
# call, and its getpid a system call).
here = False


def _forked() -> None:
    global here
    here = False


os.register_at_fork(after_in_child=_forked)


def registered(wait: float = 0.0) -> bool:
    """Whether this process takes part in the broker's barriers (waiting up to ``wait`` s for it):
    a reader may take a lease from a directory only then. The first call starts the registration
    on a thread of its own (``register``), so a connect does not wait for it; a process's first
    directory read may (once)."""
    if here:
        return True
    pid = os.getpid()
    done = _registered.get(pid)
    if done is not None:
        return done
    t = _registering.get(pid)
    if t is None:
        t = _registering[pid] = threading.Thread(target=register, name="ipcpool-membarrier", daemon=True)
        t.start()
    if wait:
        t.join(wait)
    return _registered.get(pid, False)


def register() -> bool:
    """A client: take part in the broker's expedited barriers (True where the kernel can). Once
    per process: in a process with threads the kernel waits for an RCU grace period (10 to 30 ms
    measured) to register, hence ``registered`` runs it on a thread of its own."""
    pid = os.getpid()
    done = _registered.get(pid)
    if done is None:
        supported = _call(QUERY)
        if supported < 0:
            done = False
        elif supported & REGISTER_GLOBAL_EXPEDITED:
            done = _call(REGISTER_GLOBAL_EXPEDITED) == 0
        else:
            done = bool(supported & GLOBAL)   # every process takes part in the slow one anyway
        _registered[pid] = done
        if done:
            global here
            here = True
    return done


class Fence:
    """The broker's heavy barrier, chosen once: expedited where the kernel has it."""

    def __init__(self) -> None:
        supported = _call(QUERY)
        self.cmd = (GLOBAL_EXPEDITED if supported >= 0 and supported & GLOBAL_EXPEDITED else
                    GLOBAL if supported >= 0 and supported & GLOBAL else None)

    @property
    def usable(self) -> bool:
        return self.cmd is not None

    def __call__(self) -> None:
        if self.cmd is None or _call(self.cmd) != 0:
            raise OSError(ctypes.get_errno(), "membarrier failed")
