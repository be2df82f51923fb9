"""A digest per tensor of a version, over the bytes in broker memory (GPU bytes are copied to the
host a tensor at a time to be read: a check costs a device-to-host pass)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .._client.views import raw_view
from .wire import digest


def tensor_bytes(shard: Any, offset: int, nbytes: int) -> Any:
    """The bytes of one tensor: a memoryview of host memory, or a host copy of GPU memory."""
    view = shard.memory.view
    if view is not None:
        return view[offset:offset + nbytes]
    return raw_view(shard, "torch", False)[offset:offset + nbytes].cpu().numpy()


def digests(shards: list[Any], entries: list[Any]) -> list[bytes]:
    """One digest per entry, in order; host tensors are hashed on a few threads."""
    def one(e: Any) -> bytes:
        return digest(tensor_bytes(shards[e.shard], e.offset, e.nbytes))

    if shards and shards[0].memory.view is None:   # GPU: one copy at a time bounds host memory
        return [one(e) for e in entries]
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, entries))
