"""`ipcpool load`: a safetensors file or a sharded directory becomes one checkpoint version (or,
with ``--prefix``, one sealed object per tensor as before)."""

from __future__ import annotations

import sys
from pathlib import Path

from ..sizes import format_size


def checkpoint_name(path: Path) -> str:
    """The default name: the file's stem, or the directory's name."""
    return (path.name if path.is_dir() else path.stem) or "model"


def cmd_load(args) -> int:
    from .._client.client import connect
    from .load import layout_of, load_checkpoint
    from .sources import read_source

    path = Path(args.file)
    if args.prefix is not None:   # one sealed object per tensor (the loader of before checkpoints)
        from ..loader import NotStored, load, read_header

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


def ls_rows(checkpoints: list[dict]) -> list[tuple[str, ...]]:
    """One row per live version: name, version, state, tensors, size, shards, holders; and one
    per spare (memory kept for the next version, state "spare")."""
    rows = []
    for c in checkpoints:
        rows += [(c["name"], str(v["version"]), v["state"], str(v["tensors"]), format_size(v["size"]),
                  str(v["shards"]), str(v["holders"])) for v in c["versions"]]
        if c.get("spare"):
            rows.append((c["name"], "-", "spare", "-", format_size(c["spare"]), "-", "0"))
    return rows
