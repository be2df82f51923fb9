"""Tensors at offsets of a few shards, as torch tensors or numpy / CuPy arrays, zero-copy.

One flat view per shard and dtype is made once; each tensor is then a strided view of it (a few
µs each), so a version of a thousand tensors in two shards costs two imports and a loop.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from ..errors import InvalidRequest
from ..optional import require


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


def raw_view(buf: Any, kind: str, writable: bool) -> Any:
    """A flat uint8 tensor or array over a whole shard."""
    memory = buf.memory
    if kind == "torch":
        torch = require("torch")
        if memory.view is None:
            return torch.from_dlpack(buf).view(torch.uint8)
        import numpy

        with warnings.catch_warnings():   # read-only by contract, not by page bits
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(numpy.frombuffer(memory.view, dtype=numpy.uint8))
    xp = require(kind)
    if kind == "numpy":
        if memory.view is None:
            raise InvalidRequest("numpy arrays need host memory: use kind='torch' or 'cupy' on a GPU")
        arr = xp.frombuffer(memory.view, dtype=xp.uint8)
        if not writable:
            arr.flags.writeable = False
        return arr
    return xp.asarray(buf).view(xp.uint8)


def _xp_dtype(xp: Any, name: str) -> Any:
    try:
        return xp.dtype(name)
    except TypeError:
        pass
    raise InvalidRequest(f"{xp.__name__} has no dtype {name!r}: use kind='torch'")


def _torch_dtype(name: str, dtype: str) -> Any:
    torch = require("torch")
    found = getattr(torch, dtype, None)
    if not isinstance(found, torch.dtype):
        raise InvalidRequest(f"tensor {name!r}: torch has no dtype {dtype!r}")
    return found


def shard_views(bufs: list[Any], entries: list[Any], kind: str, *, writable: bool) -> dict[str, Any]:
    """Every entry (``name, dtype, shape, shard, offset, nbytes``) as a view of its shard.
    (Modules are imported with ``require``, not cached: a process that hides torch later sees it.)"""
    if kind not in ("torch", "numpy", "cupy"):
        raise InvalidRequest(f"kind: 'torch', 'numpy' or 'cupy', not {kind!r}")
    raws: dict[int, Any] = {}
    wholes: dict[tuple[int, str], Any] = {}
    out: dict[str, Any] = {}
    xp = require(kind) if kind != "torch" else None
    for e in entries:
        if not 0 <= e.shard < len(bufs) or e.offset + e.nbytes > bufs[e.shard].size:
            raise InvalidRequest(f"tensor {e.name!r} lies outside its shard")
        whole = wholes.get((e.shard, e.dtype))
        if whole is None:
            raw = raws.get(e.shard)
            if raw is None:
                raw = raws[e.shard] = raw_view(bufs[e.shard], kind, writable)
            dtype = _torch_dtype(e.name, e.dtype) if kind == "torch" else _xp_dtype(xp, e.dtype)
            size = dtype.itemsize
            whole = wholes[(e.shard, e.dtype)] = raw[: raw.shape[0] // size * size].view(dtype)
        size = whole.itemsize if kind != "torch" else whole.element_size()
        if e.offset % size:
            raise InvalidRequest(f"tensor {e.name!r}: offset {e.offset} is not aligned to {e.dtype}")
        start, shape = e.offset // size, tuple(e.shape)
        if kind == "torch":
            out[e.name] = whole.as_strided(shape, _contiguous_strides(shape), start)
        else:
            out[e.name] = whole[start : start + math.prod(shape)].reshape(shape)
    return out
