"""Object metadata as it travels: dtype names and shapes that torch, CuPy and numpy agree on."""

from __future__ import annotations

from typing import Any


def wire_meta(meta: dict) -> dict:
    """Metadata as it travels: dtype as a name ("float32"), shape as a list of ints."""
    out = {}
    if meta.get("dtype") is not None:
        out["dtype"] = dtype_name(meta["dtype"])
    if meta.get("shape") is not None:
        out["shape"] = [int(d) for d in meta["shape"]]
    if meta.get("user"):
        out["user"] = dict(meta["user"])
    unknown = set(meta) - {"dtype", "shape", "user"}
    if unknown:
        raise ValueError(f"meta: unknown keys {sorted(unknown)}; use dtype, shape and user")
    return out


def dtype_name(dtype: Any) -> str:
    """'float32' for numpy/CuPy dtypes, torch dtypes and plain strings alike."""
    name = getattr(dtype, "name", None) or str(dtype)
    return name.removeprefix("torch.")
