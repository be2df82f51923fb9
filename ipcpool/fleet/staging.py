"""A version's memory registered with a NIXL agent: one function, ``register``, for the
serve-peer (the version it serves) and the puller (the version it fills).

The shards are registered as they are (VRAM on CUDA, DRAM on the host). Where NIXL refuses them
(UCX without CUDA support cannot register GPU memory), host buffers of the same sizes are
registered as DRAM instead and stand in for them: the side read from copies its shards into
them once, the side read into copies them into its shards once the bytes are in ("staged
through host buffers"). Where NIXL refuses those too, a TransferFailed says what and why.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy

from .._client.views import _raw
from ..errors import TransferFailed
from ..sizes import format_size
from . import nixl

log = logging.getLogger(__name__)

# Test hook: NIXL refuses to register memory, with the error it raises when UCX cannot register
# GPU memory (UCX without CUDA support). "shards": a version's own memory, which is then staged
# through host buffers; "all": any memory, host buffers included.
REFUSE_ENV = "IPCPOOL_TEST_NIXL_REFUSE"
KINDS = {"VRAM": "GPU memory", "DRAM": "host memory"}


@dataclass
class Registered:
    """What NIXL moves for one version: ``regions`` (address, size, device) of ``memory`` type:
    the shards themselves, or (``staged``: the shards' memory type) host buffers standing in."""
    agent: Any
    handle: Any
    memory: str
    regions: list[tuple[int, int, int]]
    shards: list[Any]
    staged: str | None = None
    host: list[numpy.ndarray] | None = None

    def to_host(self) -> None:
        """The shards' bytes into the host buffers (the side read from); nothing if not staged."""
        for shard, buf in zip(self.shards, self.host or ()):
            _copy(shard, buf, to_host=True)

    def from_host(self) -> None:
        """The host buffers' bytes into the shards (the side read into); nothing if not staged."""
        for shard, buf in zip(self.shards, self.host or ()):
            _copy(shard, buf, to_host=False)

    def close(self) -> None:
        self.agent.deregister_memory(self.handle)
        self.host = None


def register(agent: Any, shards: list[Any], on_gpu: bool, what: str, *, fill: bool) -> Registered:
    """``shards`` (broker buffers) registered with ``agent``, else staged through host buffers
    (filled from the shards now where ``fill``: the side read from). ``what`` names the shards in
    messages ("m@3", "the new version of m here")."""
    kind = nixl.memory_type(on_gpu)
    direct = [(b.ptr, b.size, b.device or 0) for b in shards]
    try:
        return Registered(agent, _register(agent, direct, kind, "shards"), kind, direct, shards)
    except Exception as exc:   # NIXL's own error classes
        refused = f"cannot register the {KINDS[kind]} of {what} with NIXL ({_why(exc, kind)})"
    try:
        host = [numpy.empty(b.size, numpy.uint8) for b in shards]
        regions = [(h.ctypes.data, h.nbytes, 0) for h in host]
        staged = Registered(agent, _register(agent, regions, "DRAM", "host"), "DRAM", regions, shards, kind, host)
    except Exception as exc:
        raise TransferFailed(f"{refused}, nor a host buffer to stage it through ({exc})") from exc
    log.warning("%s: staged through host buffers (%s)", refused, format_size(sum(r[1] for r in regions)))
    if fill:
        try:
            staged.to_host()
        except BaseException:
            staged.close()
            raise
    return staged


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


def _copy(shard: Any, buf: numpy.ndarray, to_host: bool) -> None:
    view = shard._memory.view
    if view is not None:   # host memory (the host backend: staged only under the test hook)
        mem = numpy.frombuffer(view, numpy.uint8, count=shard.size)
        if to_host:
            buf[:] = mem
        else:
            mem[:] = buf
        return
    import torch

    gpu, cpu = _raw(shard, "torch", False), torch.from_numpy(buf)
    if to_host:   # blocking copies (non_blocking=False): done when they return
        cpu.copy_(gpu)
    else:
        gpu.copy_(cpu)
