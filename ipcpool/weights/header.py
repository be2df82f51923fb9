"""The safetensors header: what tensors a file holds and where their bytes lie.

The format is small enough to read directly (an 8-byte little-endian header length, a JSON header
of name -> dtype, shape, data offsets, then the raw bytes), so nothing is loaded whole: a loader
reads each tensor's bytes from the offsets found here. A header is checked against the file's
size before anything is read on its word.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidRequest

# safetensors dtype codes -> the numpy-style names ipcpool's metadata uses
DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "U32": "uint32",
    "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16", "BF16": "bfloat16",
    "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class HeaderEntry:
    name: str
    dtype: str
    shape: list[int]
    start: int    # absolute file offsets
    end: int


def read_header(path: Path) -> tuple[list[HeaderEntry], dict]:
    """The file's tensors in offset order, and its ``__metadata__``."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise InvalidRequest(f"{path}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER or 8 + n > size:
            raise InvalidRequest(f"{path}: header length {n} is not plausible for a {size}-byte file")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidRequest(f"{path}: header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise InvalidRequest(f"{path}: header is not a JSON object")
    meta = header.pop("__metadata__", {}) or {}
    base = 8 + n
    entries = []
    for name, t in header.items():
        try:
            b, e = t["data_offsets"]
            dtype = DTYPES[t["dtype"]]
            shape = [int(d) for d in t["shape"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"{path}: tensor {name!r} has a bad header entry ({exc!r})") from exc
        if not (0 <= b <= e and base + e <= size):
            raise InvalidRequest(f"{path}: tensor {name!r} lies outside the file")
        entries.append(HeaderEntry(name, dtype, shape, base + b, base + e))
    entries.sort(key=lambda x: x.start)
    return entries, meta
