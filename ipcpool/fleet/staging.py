"""A version's memory registered with a NIXL agent: one function, ``register``, for the
serve-peer (the version it serves) and the puller (the version it fills).

NIXL is given the shards themselves, or buffers of the same sizes that stand in for them
("staged"): the side read from copies its shards into them once, the side read into copies them
into its shards once the bytes are in. Three kinds, cheapest first; each that NIXL (or the GPU,
out of memory) refuses falls back to the next, and where all are refused a TransferFailed says
what and why:

- ``shards``: the broker's memory as it is, no copy. On the host backend this is the default.
  Not on CUDA: the shards there are pool memory imported through CUDA IPC, which UCX mis-reads
  (it logs "VRAM memory is detected as host by UCX") and may register anyway, so that the reads
  then hang instead of failing: there is no refusal to fall back on.
- ``gpu``: plain device buffers of this process's own (cuMemAlloc: no pool, no IPC export),
  registered as VRAM, the copies device to device on the legacy stream and waited for. The
  default on CUDA: UCX takes such memory (on one node it can hand it to the peer process through
  cuda_ipc's legacy IPC handles, which pool memory has not), and a copy costs about a millisecond
  a GiB, against a round trip through the host; the price is the version's size in GPU memory on
  each side while staged (the serve-peer keeps its copy while it serves the version). Not on the
  host backend.
- ``host``: host buffers registered as DRAM, the copies between GPU and host: where UCX has no
  CUDA support at all, or the GPU has no room for the buffers. Slow, and said so by the pull.

``[nixl] staging`` (or IPCPOOL_NIXL_STAGING) picks the first kind to try ("auto": ``gpu`` on
CUDA, ``shards`` on the host; "off": ``shards``) for operators whose UCX takes pool memory, and
for tests.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import numpy

from ..config import STAGINGS, Fleet
from ..errors import ConfigError, IpcPoolError, TransferFailed
from ..sizes import format_size
from . import nixl

log = logging.getLogger(__name__)

STAGING_ENV = "IPCPOOL_NIXL_STAGING"   # overrides [nixl] staging: one of config.STAGINGS
# Test hook: NIXL refuses to register memory, with the error it raises when UCX cannot register
# GPU memory (UCX without CUDA support): a comma list of the kinds refused ("shards": a version's
# own memory, "gpu", "host": the buffers standing in for it), or "all".
REFUSE_ENV = "IPCPOOL_TEST_NIXL_REFUSE"
ORDER = ("shards", "gpu", "host")   # cheapest first
KINDS = {"VRAM": "GPU memory", "DRAM": "host memory"}
THROUGH = {"gpu": "GPU buffers", "host": "host buffers"}


def setting(fleet: Fleet) -> str:
    """The staging asked for: IPCPOOL_NIXL_STAGING, else [nixl] staging."""
    value = os.environ.get(STAGING_ENV) or fleet.staging
    if value not in STAGINGS:
        raise ConfigError(f"{STAGING_ENV}: one of {', '.join(STAGINGS)}, got {value!r}")
    return value


def attempts(asked: str, on_gpu: bool) -> list[str]:
    """The kinds to try, in order: from the one ``asked`` for on, skipping GPU buffers where the
    memory is not on a GPU."""
    first = {"auto": "gpu" if on_gpu else "shards", "off": "shards"}.get(asked, asked)
    return [k for k in ORDER[ORDER.index(first):] if on_gpu or k != "gpu"]


@dataclass
class Registered:
    """What NIXL moves for one version: ``regions`` (address, size, device) of ``memory`` type:
    the shards themselves, or (``through``: "gpu" or "host") buffers standing in for them."""
    agent: Any
    handle: Any
    memory: str
    regions: list[tuple[int, int, int]]
    shards: list[Any]
    through: str | None = None
    staged: str | None = None      # the shards' memory type, where staged
    refused: str = ""              # why the cheaper kinds were not used, where they were refused
    backend: Any = None            # copies between the shards and the buffers
    buffers: list[Any] = field(default_factory=list)   # what keeps the buffers' memory

    def to_staged(self) -> None:
        """The shards' bytes into the buffers (the side read from); nothing if not staged."""
        self._copy(lambda shard, region: (region[0], shard.ptr, shard.size))

    def from_staged(self) -> None:
        """The buffers' bytes into the shards (the side read into); nothing if not staged."""
        self._copy(lambda shard, region: (shard.ptr, region[0], shard.size))

    def _copy(self, piece: Any) -> None:
        if self.through is None:
            return
        by_device: dict[int | None, list[tuple[int, int, int]]] = {}
        for shard, region in zip(self.shards, self.regions):
            by_device.setdefault(shard.device, []).append(piece(shard, region))
        for device, pieces in by_device.items():
            self.backend.copy_memory(pieces, device)

    def close(self) -> None:
        self.agent.deregister_memory(self.handle)
        _free(self.buffers)
        self.buffers = []


def register(agent: Any, shards: list[Any], backend: Any, what: str, *, fill: bool,
             asked: str = "auto") -> Registered:
    """``shards`` (broker buffers of ``backend``'s) registered with ``agent``, or staged (filled
    from the shards now where ``fill``: the side read from), the kinds tried in the order
    ``attempts(asked)`` gives. ``what`` names the shards in messages ("m@3", "the new version of
    m here")."""
    kind = nixl.memory_type(backend.on_gpu)
    refusals: list[str] = []
    for through in attempts(asked, backend.on_gpu):
        try:
            done = _attempt(agent, shards, backend, kind, through)
        except Exception as exc:   # NIXL's own error classes, or no room for the buffers
            refusals.append(_refusal(what, kind, through, exc, first=not refusals))
            continue
        done.refused = ", ".join(refusals)
        if done.through is not None:
            _said(what, kind, done)
            if fill:
                try:
                    done.to_staged()
                except BaseException:
                    done.close()
                    raise
        return done
    raise TransferFailed(", ".join(refusals))


def _attempt(agent: Any, shards: list[Any], backend: Any, kind: str, through: str) -> Registered:
    if through == "shards":
        regions = [(b.ptr, b.size, b.device or 0) for b in shards]
        return Registered(agent, _register(agent, regions, kind, through), kind, regions, shards)
    buffers: list[Any] = []
    try:
        if through == "gpu":
            buffers = [backend.plain_device_memory(b.device, b.size) for b in shards]
            regions = [(m.ptr, m.size, m.device) for m in buffers]
            memory = "VRAM"
        else:
            buffers = [numpy.empty(b.size, numpy.uint8) for b in shards]
            regions = [(h.ctypes.data, h.nbytes, 0) for h in buffers]
            memory = "DRAM"
        handle = _register(agent, regions, memory, through)
    except BaseException:
        _free(buffers)
        raise
    return Registered(agent, handle, memory, regions, shards, through, kind, backend=backend, buffers=buffers)


def _register(agent: Any, regions: list[tuple[int, int, int]], memory: str, through: str) -> Any:
    refused = os.environ.get(REFUSE_ENV, "").split(",")
    if through in refused or "all" in refused:
        raise nixl.backend_error()
    return agent.register_memory([(*r, "") for r in regions], memory)


def _free(buffers: list[Any]) -> None:
    for b in buffers:
        if hasattr(b, "close"):   # device memory; host buffers go with their last reference
            b.close()


def _refusal(what: str, kind: str, through: str, exc: Exception, first: bool) -> str:
    memory = {"shards": kind, "gpu": "VRAM", "host": "DRAM"}[through]
    why = _why(exc, memory == "VRAM" and not isinstance(exc, IpcPoolError))   # (ours: no room for buffers)
    if not first:
        return f"nor a {THROUGH[through][:-1]} to stage it through ({why})"
    how = "" if through == "shards" else f" through a {THROUGH[through][:-1]}"
    return f"cannot register the {KINDS[kind]} of {what} with NIXL{how} ({why})"


def _said(what: str, kind: str, done: Registered) -> None:
    size = format_size(sum(r[1] for r in done.regions))
    if done.refused:
        log.warning("%s: staged through %s (%s)", done.refused, THROUGH[done.through], size)
    else:
        log.info("the %s of %s staged through %s (%s)", KINDS[kind], what, THROUGH[done.through], size)


def _why(exc: Exception, gpu: bool) -> str:
    """NIXL's error is a bare code; its reason went to the log: for GPU memory, name the usual one."""
    text = str(exc) or type(exc).__name__
    if gpu:
        text += ("; UCX likely has no CUDA support: built without it, or its CUDA module did not load "
                 "(its log then says 'VRAM memory is detected as host')")
    return text
