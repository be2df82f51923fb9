"""The hand-off's two hot requests as fixed binary frames, sent on the control socket.

A carved ``create`` and its ``seal`` are the only requests on a hand-off's path. Sent as msgpack
maps over ZeroMQ they reach the broker in 74 µs p50 on an H100 host (the writer's I/O thread, the
broker's and a wake-up: ``bench/hop.py``), and cost it ~25 µs of decoding and schema checks before
it can write the object's directory entry. On the control socket (AF_UNIX, read by the broker's
own poll) a frame arrives in 6.3 µs, and a fixed layout decodes in one ``unpack_from``.

Both are answered on the message channel like any request: by id, the refusal raised later by the
client (``_client/handoff``). The broker reads a session's waiting frames before each of its
ZeroMQ requests, so a request sent after a frame is never handled before it.

A frame starts with ``MAGIC``, a byte that begins no msgpack value: the control socket's reader
tells a frame from a control request by it. Layouts (little-endian):

- CREATE: magic, kind, pool length, name length, meta length, board slot (``NO_SLOT``: none), id,
  arena, offset, nbytes, seal number, the promised seal credit (64 bytes, zeros: none); then the
  pool name, the object name and its metadata (msgpack, as ``meta`` of a create; absent: none).
- SEAL: magic, kind, name length, id, done event (64 bytes, zeros: none); then the object name.
- NUDGE: magic, kind: wakes the broker to read the session's request ring (``shm.requests``),
  where a create frame may be put instead of this socket while the broker busy-polls.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from .errors import InvalidRequest, ProtocolError
from .protocol import MAX_ID, MAX_NAME, check_meta, check_object_name, unpack
from .sizes import HANDLE_BYTES

try:   # the usual create read in C (``shm/_native.c``), where the package was built with it
    from .shm._native import read_create as _native_read_create
except ImportError:   # (``read_create`` reads every frame in Python then)
    _native_read_create = None

MAGIC = 0xC1            # "never used" in msgpack: no msgpack request starts with it
CREATE, SEAL, NUDGE = 1, 2, 3
NO_SLOT = 0xFFFFFFFF
MAX_META = 4096         # a create's metadata in a frame (a larger one goes over the message channel)

_CREATE = struct.Struct(f"<BBHHHIQQQQQ{HANDLE_BYTES}s")
_SEAL = struct.Struct(f"<BBH8xQ{HANDLE_BYTES}s")
_KIND = struct.Struct("<BB")
_ID_AT = 12             # where the id lies in both layouts (answer even a frame that fails to decode)
_ID = struct.Struct("<Q")
_NONE = bytes(HANDLE_BYTES)
NUDGE_FRAME = bytes((MAGIC, NUDGE))   # "read my request ring" (``shm.requests``): nothing else
_CREATE_SIZE = _CREATE.size

assert _CREATE.size - HANDLE_BYTES - 5 * 8 == _ID_AT == _SEAL.size - HANDLE_BYTES - 8


def create(rid: int, pool: bytes, name: bytes, meta: bytes, arena: int, offset: int, nbytes: int,
           slot: int | None, seq: int, credit: bytes) -> bytes:
    """A carved create (``pool``, ``name``: encoded; ``meta``: packed, or empty)."""
    return _CREATE.pack(MAGIC, CREATE, len(pool), len(name), len(meta), NO_SLOT if slot is None else slot,
                        rid, arena, offset, nbytes, seq, credit) + pool + name + meta


def seal(rid: int, name: bytes, done: bytes) -> bytes:
    return _SEAL.pack(MAGIC, SEAL, len(name), rid, done) + name


# A steady writer's frames are built ahead with an empty name (``create(0, pool, b"", b"", ...)``,
# ``seal(0, b"", done)``): its create and seal then add only the id and the name (``completed``,
# or ``shm._native.ring_put`` in C). Where each layout keeps its name's length:
CREATE_NAME_LEN_AT, SEAL_NAME_LEN_AT = 4, 2
_NAME_LEN = struct.Struct("<H")


def completed(rid: int, frame: bytes, name_len_at: int, name: str) -> bytes:
    """A frame built ahead (no metadata after its empty name), with its id and name."""
    raw = name.encode()
    out = bytearray(frame)
    _NAME_LEN.pack_into(out, name_len_at, len(raw))
    _ID.pack_into(out, _ID_AT, rid)
    out += raw
    return bytes(out)


def is_frame(data: bytes) -> bool:
    return len(data) > 0 and data[0] == MAGIC


def request_id(data: bytes) -> int:
    """The id to answer a frame with (0 where it has none)."""
    if len(data) < _ID_AT + 8:
        return 0
    rid = _ID.unpack_from(data, _ID_AT)[0]
    return rid if rid < MAX_ID else 0


class Create(NamedTuple):
    """A create's request id and fields, read from a frame (``read_create``) or a message
    (``Handlers.op_create``); None: absent."""
    rid: int
    pool: str
    name: str
    nbytes: int
    meta: dict | None
    arena: int | None
    offset: int | None
    slot: int | None
    seq: int | None
    credit: bytes | None

    def fields(self) -> dict:
        """As the message channel's schema would pass them."""
        return {k: v for k, v in zip(_FIELD_NAMES, self[1:]) if v is not None}


_FIELD_NAMES = ("pool", "name", "nbytes", "meta", "arena", "offset", "slot", "seq", "seal_credit")
# A Create built without the generated ``__new__`` (a Python call): a frame's is built on the way
# to its directory entry.
_new = tuple.__new__


def kind(data: bytes) -> int:
    """A frame's kind (CREATE, SEAL or another), once its length and id are checked."""
    if len(data) < 2:
        raise ProtocolError("a frame shorter than its kind")
    if len(data) >= _ID_AT + 8 and _ID.unpack_from(data, _ID_AT)[0] >= MAX_ID:
        raise ProtocolError(_BAD_ID)
    return data[1]


_BAD_ID = "a frame's id must be in [0, 2**63)"


def parse(data: bytes) -> tuple[str, dict]:
    """A frame as (op, fields), the fields as the message channel's schema would pass them; a
    frame that does not decode, or whose fields that schema would refuse, raises."""
    k = kind(data)
    if k == CREATE:
        return "create", read_create(data).fields()
    if k == SEAL:
        return "seal", _seal_fields(data)
    raise ProtocolError(f"unknown frame kind {k}")


def read_create(data: bytes) -> Create | None:
    """A create frame read in one unpack, its id, lengths and fields checked as ``kind`` and the
    message channel's schema would; None: a frame of another kind (``parse`` reads it). The usual
    create (no metadata, an ASCII name) in one C call where built: the broker's first step on
    the way to the entry a reader waits for, which in Python costs ~5 µs of cold caches (H100
    host); anything else, and every refusal, in Python."""
    if _native_read_create is not None:
        got = _native_read_create(data)
        if got is not None:
            return _new(Create, got)
    if len(data) < _CREATE_SIZE or data[1] != CREATE:
        if kind(data) == CREATE:   # (kind's own refusals first, as for any frame)
            raise ProtocolError("a create frame shorter than its header")
        return None
    _, _, pool_len, name_len, meta_len, slot, rid, arena, offset, nbytes, seq, credit = _CREATE.unpack_from(data)
    if rid >= MAX_ID:
        raise ProtocolError(_BAD_ID)
    name_at = _CREATE_SIZE + pool_len
    meta_at = name_at + name_len
    if len(data) != meta_at + meta_len:
        raise ProtocolError("a create frame whose length does not match its header")
    if not pool_len or pool_len > MAX_NAME:
        raise InvalidRequest(f"field 'pool' must be 1 to {MAX_NAME} bytes")
    try:   # (both in one try: ``_text`` names the field that is not UTF-8)
        pool = data[_CREATE_SIZE:name_at].decode()
        name = data[name_at:meta_at].decode()
    except UnicodeDecodeError:
        _text(data[_CREATE_SIZE:name_at], "pool")
        raise ProtocolError("field 'name' is not UTF-8") from None
    check_object_name("name", name)
    meta = None
    if meta_len:
        if meta_len > MAX_META:
            raise ProtocolError(f"a create frame's metadata is at most {MAX_META} bytes")
        meta = unpack(data[meta_at:])
        check_meta("meta", meta)
    if slot == NO_SLOT:   # (a credit without a slot the create refuses: a credit goes with a board slot)
        slot = seq = None
    return _new(Create, (rid, pool, name, nbytes, meta, arena, offset, slot, seq, None if credit == _NONE else credit))


def _seal_fields(data: bytes) -> dict:
    if len(data) < _SEAL.size:
        raise ProtocolError("a seal frame shorter than its header")
    _, _, name_len, _, done = _SEAL.unpack_from(data)
    if len(data) != _SEAL.size + name_len:
        raise ProtocolError("a seal frame whose length does not match its header")
    name = _text(data[_SEAL.size:], "name")
    check_object_name("name", name)
    return {"name": name, "done_event": done} if done != _NONE else {"name": name}


def _text(raw: bytes, key: str) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise ProtocolError(f"field {key!r} is not UTF-8") from None
