"""A digest per tensor of a version, over the bytes in broker memory. GPU bytes are copied to the
host a piece at a time to be read; tensors are hashed on several threads at once (a copy and
SHA-256 both release the GIL), so a check runs at the host's copy and hashing rate, not one
core's, with host memory bounded by THREADS pieces."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .._client.views import raw_view
from .wire import HASH

PIECE = 64 << 20   # of a GPU tensor copied to the host at a time
THREADS = 8


def tensor_digest(shard: Any, offset: int, nbytes: int, piece: int = PIECE) -> bytes:
    """SHA-256 of one tensor's bytes (``wire.digest`` of them), read ``piece`` bytes at a time."""
    view = shard.memory.view
    gpu = raw_view(shard, "torch", False) if view is None else None
    h = HASH()
    for at in range(offset, offset + nbytes, piece):
        end = min(at + piece, offset + nbytes)
        h.update(view[at:end] if gpu is None else gpu[at:end].cpu().numpy())
    return h.digest()


def digests(shards: list[Any], entries: list[Any]) -> list[bytes]:
    """One digest per entry, in order."""
    with ThreadPoolExecutor(min(THREADS, max(1, len(entries)))) as pool:
        return list(pool.map(lambda e: tensor_digest(shards[e.shard], e.offset, e.nbytes), entries))
