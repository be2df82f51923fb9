"""What a puller and a serve-peer say to each other, as NIXL notifications: msgpack maps behind
a tag, so any other notification is ignored. A manifest is a version's shards (address, size,
device in the peer's memory), its entries and a digest per tensor."""

from __future__ import annotations

import hashlib
from typing import Any

import msgpack

from ..errors import ProtocolError

TAG = b"ipcpool-peer/1 "
MAX_NOTICE = 64 << 20   # a manifest of a million tensors is well under this


def encode(op: str, **fields: Any) -> bytes:
    return TAG + msgpack.packb({"op": op, **fields}, use_bin_type=True)


def decode(raw: bytes) -> dict | None:
    """The message, or None for a notification that is not ours. A malformed one of ours raises
    ProtocolError (the server answers it with an error; it never stops serving)."""
    if not raw.startswith(TAG):
        return None
    if len(raw) > MAX_NOTICE:
        raise ProtocolError(f"a notification of {len(raw)} bytes: at most {MAX_NOTICE}")
    try:
        msg = msgpack.unpackb(raw[len(TAG):], raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"not msgpack: {exc}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str) or not isinstance(msg.get("req"), str):
        raise ProtocolError("a message is a map with 'op' and 'req'")
    return msg


HASH = hashlib.sha256   # (hashlib releases the GIL while it reads; with the CPU's SHA instructions about 2 GB/s a core)


def digest(data: Any) -> bytes:
    """A tensor's digest: SHA-256 of its bytes (``HASH``; fed piece by piece, the same digest)."""
    return HASH(data).digest()
