"""What a checkpoint is loaded from: one safetensors file, or a directory of them (Hugging Face's
sharded layout, ``model.safetensors.index.json``, or every ``*.safetensors`` file in it)."""

from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidRequest
from .header import read_header
from .layout import TensorSpec

INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class SourceTensor:
    spec: TensorSpec
    path: Path
    start: int                     # absolute offsets in the file
    end: int


def read_source(path: str | os.PathLike) -> list[SourceTensor]:
    """Every tensor of a file or a sharded directory, file by file in offset order."""
    path = Path(path)
    if path.is_dir():
        index = path / INDEX
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise InvalidRequest(f"{index}: not a safetensors index ({exc!r})") from exc
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise InvalidRequest(f"{path}: no {INDEX} and no .safetensors files")
        paths = [path / f for f in files]
        for p in paths:
            if p.parent != path or not p.is_file():
                raise InvalidRequest(f"{path}: shard {p.name!r} is missing")
    elif path.is_file():
        paths = [path]
    else:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
    out: list[SourceTensor] = []
    seen: dict[str, Path] = {}
    for p in paths:
        entries, _meta = read_header(p)
        for e in entries:
            if e.name in seen:
                raise InvalidRequest(f"tensor {e.name!r} is in both {seen[e.name].name} and {p.name}")
            seen[e.name] = p
            out.append(SourceTensor(TensorSpec(e.name, e.dtype, tuple(e.shape)), p, e.start, e.end))
    return out
