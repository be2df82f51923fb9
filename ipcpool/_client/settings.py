"""What a client reads from the environment: once, when it connects (never at import)."""

from __future__ import annotations

import os
from dataclasses import dataclass


def env_us(name: str, default: int) -> float:
    """A duration in µs from the environment, in seconds."""
    return int(os.environ.get(name, str(default))) / 1e6


@dataclass(frozen=True)
class Settings:
    spin_s: float       # IPCPOOL_CLIENT_SPIN_US: a reply is polled for this long before sleeping
    arena_bytes: int    # IPCPOOL_ARENA_BYTES (or connect's arena_bytes): one arena; 0 turns arenas off
    get_spin_s: float   # IPCPOOL_GET_SPIN_US: a get spins this long for a seal (0 where spin_s is)

    @classmethod
    def from_env(cls, arena_bytes: int | None) -> Settings:
        spin_s = env_us("IPCPOOL_CLIENT_SPIN_US", 300)
        if arena_bytes is None:   # the broker may grant less
            arena_bytes = int(os.environ.get("IPCPOOL_ARENA_BYTES", str(32 << 20)))
        else:
            arena_bytes = max(0, int(arena_bytes))
        get_spin_s = env_us("IPCPOOL_GET_SPIN_US", 1000) if spin_s else 0.0
        return cls(spin_s, arena_bytes, get_spin_s)
