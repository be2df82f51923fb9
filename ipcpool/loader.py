"""`ipcpool load`: stream a safetensors file into sealed named objects.

The format is small enough to read directly (an 8-byte little-endian header length, a JSON header
of name -> dtype, shape, data offsets, then the raw bytes), so nothing is loaded whole: each tensor
is read from the file straight into broker memory (host) or through a bounded chunk (CUDA).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._client.client import Client
from .errors import InvalidRequest, IpcPoolError
from .progress import Progress

# safetensors dtype codes -> the numpy-style names ipcpool's metadata uses
DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "U32": "uint32",
    "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16", "BF16": "bfloat16",
    "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
MAX_HEADER = 100 << 20
CHUNK = 16 << 20


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: list[int]
    start: int    # absolute file offsets
    end: int


def read_header(path: Path) -> tuple[list[Entry], dict]:
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
        entries.append(Entry(name, dtype, shape, base + b, base + e))
    entries.sort(key=lambda x: x.start)
    return entries, meta


class NotStored(IpcPoolError):
    """Some tensors of a file were not stored; ``failed`` maps each one's object name to why."""

    def __init__(self, path: Path, stored: int, failed: dict[str, IpcPoolError]):
        self.failed = failed
        listed = "; ".join(f"{name}: {err}" for name, err in list(failed.items())[:10])
        more = f"; and {len(failed) - 10} more" if len(failed) > 10 else ""
        super().__init__(f"{path}: {len(failed)} tensor(s) not stored ({stored} stored): {listed}{more}")


def load(client: Client, path: str | os.PathLike, *, prefix: str = "", pool: str = "default",
         show_progress: bool = True, overwrite: bool = False) -> list[str]:
    """Create one sealed object per tensor, named ``prefix + tensor name``; return the names.

    Every create is settled before this returns: where the broker refused some (a name that
    exists, a quota), the rest are still stored and ``NotStored`` names each one refused.
    ``overwrite``: an object of the same name is deleted first (readers holding it keep theirs)."""
    path = Path(path)
    entries, file_meta = read_header(path)
    user = {k: v for k, v in file_meta.items() if isinstance(v, str)} if isinstance(file_meta, dict) else {}
    user = dict(list(user.items())[:32])
    total = sum(e.end - e.start for e in entries)
    existing = {o["name"] for o in client.list(prefix)} if overwrite else set()
    sent: dict[str, Any] = {}                  # name -> its buffer, sealed without waiting
    failed: dict[str, IpcPoolError] = {}
    bar = Progress(f"loading {path.name}", total, unit="B") if show_progress else None
    try:
        with open(path, "rb", buffering=0) as f:
            for e in entries:
                name = prefix + e.name
                nbytes = e.end - e.start
                try:
                    if name in existing:
                        client.delete(name)
                    buf = _create(client, sent, name, max(nbytes, 1), pool,
                                  {"dtype": e.dtype, "shape": e.shape, **({"user": user} if user else {})})
                except IpcPoolError as exc:
                    failed[name] = exc
                    if bar:
                        bar.update(nbytes)
                    continue
                _fill(f, buf, e, path, bar)
                sent[name] = buf
                try:
                    buf.seal()
                except IpcPoolError as exc:   # its create's refusal, known by now
                    failed[name] = exc
            try:
                client.flush()   # every create and seal answered: each refusal is on its buffer
            except IpcPoolError:
                pass
    finally:
        if bar:
            bar.close()
    for name, buf in sent.items():
        if buf.refusal is not None:
            failed.setdefault(name, buf.refusal)
    stored = [n for n in sent if n not in failed]
    if failed:
        raise NotStored(path, len(stored), failed)
    return stored


def _create(client: Client, sent: dict[str, Any], name: str, nbytes: int, pool: str, meta: dict) -> Any:
    """``client.create``, where a refusal it raises of an earlier tensor (sent without waiting)
    stays that tensor's (``Buffer.refusal``) and this create is made again."""
    while True:
        try:
            return client.create(name, nbytes, pool=pool, meta=meta)
        except IpcPoolError as exc:
            if not any(exc is b.refusal for b in sent.values()):
                raise


def _fill(f, buf: Any, e: Entry, path: Path, bar: Progress | None) -> None:
    nbytes = e.end - e.start
    f.seek(e.start)
    for off in range(0, nbytes, CHUNK):
        n = min(CHUNK, nbytes - off)
        if buf.device is None:      # host: read straight into broker memory
            got = f.readinto(buf.view[off : off + n])
        else:
            chunk = f.read(n)
            got = len(chunk)
            buf.write(chunk, off)
        if got != n:
            buf.free()
            raise InvalidRequest(f"{path}: short read in tensor {e.name!r}")
        if bar:
            bar.update(n)
