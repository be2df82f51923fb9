"""A version's memory registered with a NIXL agent: one function, ``register``, for the
serve-peer (the version it serves) and the puller (the version it fills). A refusal by NIXL
becomes a TransferFailed that says what could not be registered and the likely cause."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..errors import TransferFailed
from . import nixl

# Test hook: NIXL refuses to register memory, with the error it raises when UCX cannot register
# GPU memory (UCX without CUDA support). "shards": a version's own memory; "all": any memory.
REFUSE_ENV = "IPCPOOL_TEST_NIXL_REFUSE"
KINDS = {"VRAM": "GPU memory", "DRAM": "host memory"}


@dataclass
class Registered:
    """What NIXL moves for one version: ``regions`` (address, size, device) of ``memory`` type."""
    agent: Any
    handle: Any
    memory: str
    regions: list[tuple[int, int, int]]

    def close(self) -> None:
        self.agent.deregister_memory(self.handle)


def register(agent: Any, shards: list[Any], on_gpu: bool, what: str) -> Registered:
    """``shards`` (broker buffers) registered with ``agent``; ``what`` names them in an error
    ("m@3", "the new version of m here")."""
    memory = nixl.memory_type(on_gpu)
    regions = [(b.ptr, b.size, b.device or 0) for b in shards]
    try:
        return Registered(agent, _register(agent, regions, memory, "shards"), memory, regions)
    except Exception as exc:   # NIXL's own error classes: translated here
        raise TransferFailed(f"cannot register the {KINDS[memory]} of {what} with NIXL ({_why(exc, memory)})") from exc


def _register(agent: Any, regions: list[tuple[int, int, int]], memory: str, which: str) -> Any:
    if os.environ.get(REFUSE_ENV) in (which, "all"):
        raise nixl.backend_error()
    return agent.register_memory([(*r, "") for r in regions], memory)


def _why(exc: Exception, memory: str) -> str:
    """NIXL's error is a bare code; its reason went to the log: for GPU memory, name the usual one."""
    text = str(exc) or type(exc).__name__
    if memory == "VRAM":
        text += ("; UCX likely has no CUDA support: built without it, or its CUDA module did not load "
                 "(its log then says 'VRAM memory is detected as host')")
    return text
