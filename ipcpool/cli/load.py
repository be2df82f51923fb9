"""`ipcpool load`: a safetensors file or a sharded directory becomes one checkpoint version, or,
with ``--prefix``, one sealed object per tensor (``load``).

Nothing is loaded whole: each tensor is read from the file straight into broker memory (host) or
through a bounded chunk (CUDA); ``weights.header`` says where its bytes lie.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from .._client.client import Client, connect
from ..errors import InvalidRequest, IpcPoolError
from ..progress import Progress
from ..sizes import format_size
from ..weights.header import HeaderEntry, read_header
from ..weights.load import layout_of, load_checkpoint
from ..weights.sources import read_source

CHUNK = 16 << 20


def checkpoint_name(path: Path) -> str:
    """The default name: the file's stem, or the directory's name."""
    return (path.name if path.is_dir() else path.stem) or "model"


def cmd_load(args) -> int:
    path = Path(args.file)
    if args.prefix is not None:   # one sealed object per tensor (the loader of before checkpoints)
        read_header(path)
        with connect(args.socket_dir) as client:
            try:
                names = load(client, path, prefix=args.prefix, pool=args.pool, overwrite=args.overwrite)
            except NotStored as exc:   # every tensor not stored named, and a non-zero exit
                for tensor, err in exc.failed.items():
                    print(f"ipcpool load: not stored: {tensor}: {' '.join(str(err).split())}", file=sys.stderr)
                hint = "" if args.overwrite else " (--overwrite replaces objects that exist)"
                print(f"ipcpool load: {len(exc.failed)} tensor(s) of {path} not stored{hint}", file=sys.stderr)
                return 1
        print(f"loaded {len(names)} tensor(s) from {path} as sealed objects under {args.prefix or '(no prefix)'}")
        return 0
    sources = read_source(path)   # a missing or broken file is refused before the broker is asked
    layout_of(sources, 1 << 62)
    name = args.name or checkpoint_name(path)
    with connect(args.socket_dir) as client:
        version = load_checkpoint(client, name, path, pool=args.pool, progress=True)
    total = sum(s.end - s.start for s in sources)
    print(f"loaded {len(sources)} tensor(s), {format_size(total)}, from {path} as checkpoint {name!r} version {version}")
    return 0


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


def _fill(f, buf: Any, e: HeaderEntry, path: Path, bar: Progress | None) -> None:
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
