"""torch: publish live tensors as a version, and make a module's weights a checkpoint's tensors.

``publish_tensors`` copies device to device (or host to host) into the version's shards on one
stream: no host round trip. ``bind_module`` swaps a module's parameters and persistent buffers for
the checkpoint's tensors (zero-copy) or copies them in (``copy=True``), after checking every name,
shape and dtype; tied weights (one tensor under two names) need only one of their names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import trace
from ..errors import InvalidRequest
from ..meta import dtype_name
from ..optional import require
from .layout import DEFAULT_SHARD_BYTES, TensorSpec, plan


def publish_tensors(client: Any, name: str, tensors: Mapping[str, Any], *, pool: str = "default",
                    stream: Any = None, user: dict | None = None, shard_bytes: int = DEFAULT_SHARD_BYTES) -> int:
    """A new version of ``name`` holding a copy of ``tensors`` (torch, on the client's kind of
    memory), made current once the copies on ``stream`` (torch's current one by default) are done.
    Returns its number."""
    torch = require("torch")
    items = list(tensors.items())
    specs = [TensorSpec(k, dtype_name(t.dtype), tuple(t.shape)) for k, t in items]
    shards, entries = plan(specs, shard_bytes)
    on_gpu = client.parts.backend.on_gpu
    for k, t in items:
        if bool(t.is_cuda) != on_gpu:
            raise InvalidRequest(f"tensor {k!r} is on {t.device}: this broker holds {'GPU' if on_gpu else 'host'} memory")
    device = items[0][1].device if items and on_gpu else None
    s = (torch.cuda.current_stream(device) if stream is None else stream) if on_gpu else None
    with client.parts.checkpoints.begin(name, shards, entries, pool=pool, user=user, exclusive=False, stream=s) as w:
        views = w.tensors("torch")
        if on_gpu:
            with torch.cuda.stream(s):
                _copy_all(torch, [views[k] for k, _ in items], [t.detach() for _, t in items])
        else:
            _copy_all(torch, [views[k] for k, _ in items], [t.detach() for _, t in items])
        return w.publish(s)


@trace.phase("copy")
def _copy_all(torch: Any, dsts: list[Any], srcs: list[Any]) -> None:
    """One fused launch per group where torch offers it (hundreds of tensors: no launch each)."""
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        try:
            foreach(dsts, srcs, non_blocking=True)
            return
        except (RuntimeError, TypeError):
            pass   # (mixed layouts or devices: the plain loop below)
    for d, s in zip(dsts, srcs):
        d.copy_(s, non_blocking=True)


def _targets(module: Any) -> dict[str, Any]:
    """Parameters and persistent buffers by state-dict name (tied ones appear under each name)."""
    return dict(module.state_dict(keep_vars=True))


def check_module(module: Any, tensors: Mapping[str, Any]) -> dict[str, str]:
    """Refuse, naming the first mismatch, unless every name of ``module`` has a tensor of the same
    shape and dtype (a tied weight: under one of its names) and ``tensors`` has nothing else.
    Returns each module name -> the checkpoint name it takes."""
    targets = _targets(module)
    by_obj: dict[int, list[str]] = {}
    for k, v in targets.items():
        by_obj.setdefault(id(v), []).append(k)
    source: dict[str, str] = {}
    for k, v in targets.items():
        found = k if k in tensors else next((a for a in by_obj[id(v)] if a in tensors), None)
        if found is None:
            raise InvalidRequest(f"the checkpoint has no tensor {k!r} (the module's {len(targets)} names must all be there)")
        t = tensors[found]
        if tuple(t.shape) != tuple(v.shape):
            raise InvalidRequest(f"{k!r}: the module has shape {list(v.shape)}, the checkpoint {list(t.shape)}")
        if t.dtype != v.dtype:
            raise InvalidRequest(f"{k!r}: the module has dtype {dtype_name(v.dtype)}, the checkpoint {dtype_name(t.dtype)}")
        source[k] = found
    extra = sorted(set(tensors) - set(source.values()))
    if extra:
        raise InvalidRequest(f"the checkpoint's tensor {extra[0]!r} is not in the module"
                             + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    return source


def bind_module(module: Any, tensors: Mapping[str, Any], *, copy: bool = False) -> Any:
    """Make ``module``'s parameters and persistent buffers ``tensors`` (a checkpoint's, by
    state-dict name): zero-copy views, or with ``copy=True`` copies into the module's own memory.
    Checked first (``check_module``); returns the module."""
    torch = require("torch")
    source = check_module(module, tensors)
    if copy:
        with torch.no_grad():
            for k, v in _targets(module).items():
                v.copy_(tensors[source[k]])
        return module
    made: dict[str, Any] = {}   # one new Parameter per checkpoint tensor: ties stay tied
    for k in source:
        owner_name, _, leaf = k.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        t = tensors[source[k]]
        if leaf in owner._parameters:
            old = owner._parameters[leaf]
            p = made.get(source[k])
            if p is None:
                p = made[source[k]] = torch.nn.Parameter(t, requires_grad=old.requires_grad)
            owner._parameters[leaf] = p
        else:
            owner._buffers[leaf] = t
    return module
