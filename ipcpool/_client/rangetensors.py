"""Tensors over slab ranges, kept for each range's next object (``interop.Views``).

A writer (or reader) of one size of object meets the same few ranges in turn (``handoff.ClientArena``),
and a torch view made right after the worker wakes costs several times one made in a loop (on an H100
host: 2.6 µs in a loop, 6.6 after a 300 µs sleep, 20.2 after 1 ms). The tensor last made over a range
is handed out again where nobody holds it and it is as it was made.
"""

from __future__ import annotations

import sys
from typing import Any


def _refs_when_unshared() -> int:
    """``sys.getrefcount`` of a value held only by a dict, read into a local (as ``RangeTensors``
    reads one): the count that says nobody else holds it, whatever this Python counts."""
    kept = {0: object()}
    value = kept[0]
    return sys.getrefcount(value)


class RangeTensors:
    """The tensor last made over each slab range, by key. "As made": the same memory, shape,
    strides and dtype, no gradient asked for or given; checked, ~8 µs after a 1 ms sleep on an H100
    host. A tensor someone still holds is never handed out twice (the count of references says so)."""

    MAX = 4096   # ranges remembered; past them, forgotten

    def __init__(self) -> None:
        self._kept: dict[tuple, Any] = {}

    def get(self, key: tuple, ptr: int, shape: tuple, strides: tuple, dtype: Any) -> Any:
        t = self._kept.get(key)
        if (t is not None and sys.getrefcount(t) == _UNSHARED and not t.requires_grad and t.grad is None
                and t.data_ptr() == ptr and t.shape == shape and t.stride() == strides and t.dtype is dtype):
            return t
        return None

    def keep(self, key: tuple, t: Any) -> Any:
        kept = self._kept
        if len(kept) >= self.MAX:
            kept.clear()
        kept[key] = t
        return t

    def clear(self) -> None:
        self._kept.clear()


_UNSHARED = _refs_when_unshared()
