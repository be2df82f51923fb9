"""What a client reads from the environment: once, when it connects (never at import)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..cpus import spin_default


def env_int(name: str, default: int | None) -> int | None:
    """A non-negative int from the environment (unset or empty: ``default``); anything else is a
    ValueError that names the variable."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {raw[:40]!r}")
    return value


def env_us(name: str, default: int) -> float:
    """A duration in µs from the environment, in seconds."""
    return env_int(name, default) / 1e6


@dataclass(frozen=True)
class Settings:
    spin_s: float       # IPCPOOL_CLIENT_SPIN_US: a reply is polled for this long before sleeping
    arena_bytes: int    # IPCPOOL_ARENA_BYTES (or connect's arena_bytes): one arena; 0 turns arenas off
    get_spin_s: float   # IPCPOOL_GET_SPIN_US: a get spins this long for a seal (unset: 0 where spin_s is)
    # IPCPOOL_GROWABLE_SPAN: bytes of address space a CUDA client reserves for each growable buffer
    # it maps (None: the device's memory, so growth never moves it; 0: twice its size, then more)
    growable_span: int | None = None

    @classmethod
    def from_env(cls, arena_bytes: int | None) -> Settings:
        spin_s = env_us("IPCPOOL_CLIENT_SPIN_US", spin_default(300))   # (0 on fewer than 4 CPUs)
        if arena_bytes is None:   # the broker may grant less
            arena_bytes = env_int("IPCPOOL_ARENA_BYTES", 32 << 20)
        else:
            arena_bytes = max(0, int(arena_bytes))
        # (set, it is used; else 1 ms, or 0 where the client does not spin for replies)
        get_spin_s = env_us("IPCPOOL_GET_SPIN_US", 1000) if spin_s or "IPCPOOL_GET_SPIN_US" in os.environ else 0.0
        return cls(spin_s, arena_bytes, get_spin_s, env_int("IPCPOOL_GROWABLE_SPAN", None))
