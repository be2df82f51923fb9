"""Safetensors files written by hand (the format is small), and a sample set of tensors."""

import json
import struct

import numpy as np


def write_safetensors(path, tensors):
    """A safetensors file (the format is small: header length, JSON header, bytes)."""
    codes = {"float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32"}
    header, blobs, at = {}, [], 0
    for name, arr in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": codes[str(arr.dtype)], "shape": list(arr.shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def sample_tensors(seed=0):
    rng = np.random.default_rng(seed)
    return {"a.weight": rng.standard_normal((128, 64)).astype(np.float32),
            "a.bias": rng.standard_normal((64,)).astype(np.float16),
            "count": np.arange(7, dtype=np.int64)}
