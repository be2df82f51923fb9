"""Load a checkpoint version from safetensors files, and the elected-loader protocol.

The file bytes go straight into the version's shards through the client backend's
``read_files`` (host: read into broker memory; CUDA: pinned buffers, reads and copies overlapped).
Nothing is visible to readers until the publish; a loader that fails or dies leaves nothing.
"""

from __future__ import annotations

import os
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from ..errors import InvalidRequest, ObjectNotFound, WaitTimeout
from ..progress import Progress
from .layout import DEFAULT_SHARD_BYTES, plan
from .sources import SourceTensor, read_source


def layout_of(sources: list[SourceTensor], shard_bytes: int) -> tuple[list[int], list]:
    for s in sources:
        if s.spec.nbytes != s.end - s.start:
            raise InvalidRequest(f"{s.path.name}: tensor {s.spec.name!r} is {s.spec.dtype} {list(s.spec.shape)} "
                                 f"({s.spec.nbytes} bytes) but holds {s.end - s.start} bytes")
    return plan([s.spec for s in sources], shard_bytes)


def _fill(client: Any, w: Any, sources: list[SourceTensor], label: str, progress: bool, stream: Any) -> int:
    """Read every tensor into ``w`` and publish it; returns the version number."""
    total = sum(s.end - s.start for s in sources)
    bar = Progress(f"loading {label}", total, unit="B") if progress else None
    with ExitStack() as stack:
        if bar is not None:
            stack.callback(bar.close)
        fds: dict[Path, int] = {}
        for s in sources:
            if s.path not in fds:
                fds[s.path] = os.open(s.path, os.O_RDONLY)
                stack.callback(os.close, fds[s.path])
        memories = [b.memory for b in w.shards]
        jobs = [(fds[s.path], s.start, memories[e.shard], e.offset, e.nbytes) for s, e in zip(sources, w.entries)]
        client.parts.backend.read_files(jobs, stream, bar.update if bar is not None else None)
        return w.publish(stream)


def load_checkpoint(client: Any, name: str, path: str | os.PathLike, *, pool: str = "default",
                    shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool = True, stream: Any = None,
                    user: dict | None = None) -> int:
    """Publish a new version of ``name`` from a safetensors file or a sharded directory; returns
    its number."""
    sources = read_source(path)
    shards, entries = layout_of(sources, shard_bytes)
    # (keep=False: a loader publishes once; nothing of its version comes back to it as a spare)
    with client.parts.checkpoints.begin(name, shards, entries, pool=pool, user=user, exclusive=False, stream=stream,
                                   keep=False) as w:
        return _fill(client, w, sources, Path(path).name, progress, stream)


def load_or_attach(client: Any, name: str, path: str | os.PathLike, *, pool: str = "default", kind: str = "torch",
                   timeout: float | None = None, shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool = True,
                   stream: Any = None) -> Any:
    """Attach ``name``; where it has no version yet, the first caller loads it from ``path`` and
    the others wait for its publish. A loader that dies is replaced by the next caller to ask."""
    sources = read_source(path)
    shards, entries = layout_of(sources, shard_bytes)
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = 0.002
    while True:
        got = client.parts.checkpoints.begin(name, shards, entries, pool=pool, user=None, exclusive=True, stream=stream,
                                        keep=False)
        if not isinstance(got, dict):   # a VersionWriter: this caller loads
            with got:
                number = _fill(client, got, sources, Path(path).name, progress, stream)
            try:
                return client.attach(name, version=number, kind=kind, stream=stream)
            except ObjectNotFound:   # replaced and gone already: the current one then
                return client.attach(name, kind=kind, stream=stream)
        if got.get("current") is not None:
            try:
                return client.attach(name, kind=kind, stream=stream)
            except ObjectNotFound:   # deleted meanwhile: ask again
                pass
        if deadline is not None and time.monotonic() >= deadline:
            raise WaitTimeout(f"checkpoint {name!r}: another process is loading it and did not publish "
                              f"within {timeout} s")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
