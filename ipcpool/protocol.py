"""Versioned, bounded messages <-> msgpack, shared by the broker and the client.

Each request is a msgpack map ``{"op": str, "id": int, ...}``; each reply is
``{"id": int, "ok": True, ...}`` or ``{"id": int, "ok": False, "code": int, "error": str}``.
Requests are checked field by field against a schema before the broker acts on them, so bad input
becomes an error reply (never an ``assert``, never a crash).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from .errors import InvalidRequest, IpcPoolError, ProtocolError, error_from_wire
from .sizes import HANDLE_BYTES

# 2: growables are created, attached, grown and synced on the control socket, whose replies carry
# chunk FDs and, once a session, the growth board's FD. A version-1 client is refused at hello.
PROTOCOL_VERSION = 2

# Limits. A message carries at most a few handles of 64 bytes, a name and small metadata.
MAX_MESSAGE = 64 * 1024          # bytes of a request, on either channel
MAX_REPLY = 16 << 20             # bytes of a broker's reply (a batch of leases is larger)
MAX_BATCH = 1024                 # names in one get_many
MAX_STR = 4096
MAX_BIN = 1024
MAX_ARRAY = 1024
MAX_MAP = 256
MAX_NAME = 255
ARENA_ALIGN = 512                # offsets a client carves in its arena (both sides round alike)
MAX_ARENAS = 8                   # arenas per session and pool
MAX_ERROR = 1024                 # characters of an error reply's text (a client decodes up to MAX_STR)
MAX_ID = 1 << 63                 # request ids are ints in [0, MAX_ID)
LIST_PAGE = 1000                 # entries of a list (objects, growables, a watch's existing) per reply
MAX_WAIT_MS = (1 << 31) - 1      # the longest a get may wait for its seal (poll's limit: 24.8 days)

_UNPACK_LIMITS = dict(
    max_str_len=MAX_STR,
    max_bin_len=MAX_BIN,
    max_array_len=MAX_ARRAY,
    max_map_len=MAX_MAP,
    max_ext_len=0,
)


def pack(obj: dict) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes, limit: int = MAX_MESSAGE) -> dict:
    """Decode one message; anything but a bounded msgpack map is a ProtocolError."""
    if len(data) > limit:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the limit of {limit}")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, **_UNPACK_LIMITS)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"undecodable message: {type(exc).__name__}: {exc}") from exc
    if not isinstance(obj, dict):
        raise ProtocolError(f"message must be a map, got {type(obj).__name__}")
    return obj


@dataclass(frozen=True)
class Field:
    kind: type | tuple[type, ...]
    required: bool = True
    max_len: int | None = None
    min_value: int | None = None
    check: Callable[[str, Any], None] | None = None   # raises ProtocolError / InvalidRequest


# Object names: path-like, so prefixes ("weights/layer1/") group them. One pattern for the rule
# (a create checks a fresh name each time), its length aside (``check_object_name``: cheaper than a
# lookahead): letters, digits and '._:/-', starting with a letter or digit; its '/'-separated parts
# are not empty (a trailing '/' is allowed) and none is '.' or '..'.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*(?:/(?!\.\.?(?:/|\Z))[A-Za-z0-9._:-]+)*/?")
DTYPE_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")
MAX_DIMS = 32
MAX_USER_KEYS = 64


# Names found valid, so that a worker attaching to the same thousand names again costs a set lookup
# each (bounded: emptied when full).
_VALID_NAMES: set[str] = set()
_VALID_NAMES_MAX = 1 << 14
_VALID_HEADS: set[str] = set()   # what comes before the last "/" of a name found valid (bounded alike)


def valid_object_name(name: str) -> bool:
    """Whether ``name`` (a str) is a valid object name; remembered where it is. A writer's next
    name is often its last one's head and a new number ("step/41", "step/42"): a head seen in a
    valid name and a part of ASCII digits make a valid name, without the regex, whose first run
    after a worker's sleep costs microseconds."""
    if name in _VALID_NAMES:
        return True
    head, _, tail = name.rpartition("/")
    if head in _VALID_HEADS and tail.isdigit() and tail.isascii() and len(name) <= MAX_NAME:
        return True
    if len(name) > MAX_NAME or not NAME_RE.fullmatch(name):
        return False
    if len(_VALID_NAMES) >= _VALID_NAMES_MAX:
        _VALID_NAMES.clear()
        _VALID_HEADS.clear()
    _VALID_NAMES.add(name)
    if head and tail:   # (every part of it checked, the next-to-last one included)
        _VALID_HEADS.add(head)
    return True


def check_object_name(key: str, name: str) -> None:
    if type(name) is not str:   # (a client's own call: bytes, None or a number, say)
        raise InvalidRequest(f"{key}: an object name is a str, not {type(name).__name__}")
    if not valid_object_name(name):
        raise InvalidRequest(
            f"{key}: invalid object name {name[:80]!r}: 1-255 characters of letters, digits and "
            "'._:/-', starting with a letter or digit, without empty, '.' or '..' path parts"
        )


def check_meta(key: str, meta: dict) -> None:
    """Object metadata: optional dtype (a numpy-style name), shape, and a small user map."""
    unknown = set(meta) - {"dtype", "shape", "user"}
    if unknown:
        raise InvalidRequest(f"{key}: unknown metadata keys {sorted(map(str, unknown))}")
    dtype = meta.get("dtype")
    if dtype is not None and not (isinstance(dtype, str) and DTYPE_RE.fullmatch(dtype)):
        raise InvalidRequest(f"{key}.dtype: a dtype name such as 'float32', got {dtype!r}")
    shape = meta.get("shape")
    if shape is not None and not (
        isinstance(shape, list) and len(shape) <= MAX_DIMS
        and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 62 for d in shape)
    ):
        raise InvalidRequest(f"{key}.shape: a list of at most {MAX_DIMS} non-negative ints")
    user = meta.get("user")
    if user is not None:
        if not isinstance(user, dict) or len(user) > MAX_USER_KEYS:
            raise InvalidRequest(f"{key}.user: a map of at most {MAX_USER_KEYS} entries")
        for k, v in user.items():
            if not isinstance(k, str) or len(k) > 64:
                raise InvalidRequest(f"{key}.user: keys are strings of at most 64 characters")
            if not isinstance(v, (str, int, float, bool)) or (isinstance(v, str) and len(v) > 1024):
                raise InvalidRequest(f"{key}.user[{k!r}]: a string (at most 1024), number or bool")


def _u64(required: bool = True) -> Field:
    return Field(int, required, min_value=0)


def _bin(required: bool = True, max_len: int = HANDLE_BYTES) -> Field:
    return Field(bytes, required, max_len=max_len)


def check_event(key: str, handle: bytes) -> None:
    """An IPC event handle: exactly HANDLE_BYTES, or empty (none). Refused here, before any state
    changes: a free or seal that failed on it halfway would leave its memory behind."""
    if handle and len(handle) != HANDLE_BYTES:
        raise InvalidRequest(f"{key}: an IPC event handle is {HANDLE_BYTES} bytes, got {len(handle)}")


def _event() -> Field:
    return Field(bytes, False, max_len=HANDLE_BYTES, check=check_event)


def _name(required: bool = True) -> Field:
    return Field(str, required, max_len=MAX_NAME)


def check_names(key: str, names: list) -> None:
    if not names:
        raise InvalidRequest(f"{key}: at least one name")
    valid = _VALID_NAMES
    for i, name in enumerate(names):
        if not isinstance(name, str):
            raise InvalidRequest(f"{key}[{i}]: a name is a string")
        if name not in valid:
            check_object_name(f"{key}[{i}]", name)


def check_wait(key: str, ms: int) -> None:
    if ms > MAX_WAIT_MS:
        raise InvalidRequest(f"{key}: at most {MAX_WAIT_MS} ms, got {ms}")


def check_wake(key: str, wake: str) -> None:
    if wake not in ("entry", "seal"):
        raise InvalidRequest(f"{key}: 'entry' or 'seal', got {wake[:20]!r}")


def check_kind(key: str, kind: str) -> None:
    if kind not in ("objects", "growables"):
        raise InvalidRequest(f"{key}: 'objects' or 'growables', got {kind[:20]!r}")


def _object_name(required: bool = True) -> Field:
    return Field(str, required, check=check_object_name)   # the check bounds its length


# Requests on the message channel, op -> schema (besides "op" and "id").
REQUESTS: dict[str, dict[str, Field]] = {
    # With ``arena`` and ``offset``: the range the client carved in its arena (sent without waiting).
    "allocate": {"nbytes": _u64(), "pool": _name(), "arena": _u64(required=False), "offset": _u64(required=False)},
    # By ``alloc``, or by the arena range it was carved at (freed before its reply came back).
    # ``name``: a create's buffer given up before its seal, which aborts that object.
    "free": {"alloc": _u64(required=False), "arena": _u64(required=False), "offset": _u64(required=False),
             "done_event": _event(), "name": _object_name(required=False)},
    "share": {"alloc": _u64()},
    "open": {"token": _bin(max_len=32)},
    "bye": {},
    "stats": {},
    "reset_high": {"pool": _name(required=False)},
    "trim": {"pool": _name(), "keep": _u64()},
    "set_release_threshold": {"pool": _name(), "bytes": _u64()},
    "ping": {},
    # One-way: only its ``read`` (bytes taken in), from a client that reads notices and asks nothing.
    "ack": {},
    # With ``arena`` and ``offset``: the object is the range the client carved in its arena.
    # ``slot``/``seq``: the writer will post ``seq`` in that word of its arena's seal-board block once
    # its seal is recorded, on ``seal_credit`` (a credit of its own, CUDA); see ``ipcpool.shm.sealboard``.
    "create": {"name": _object_name(), "nbytes": _u64(), "pool": _name(), "meta": Field(dict, False, check=check_meta),
               "arena": _u64(required=False), "offset": _u64(required=False), "slot": _u64(required=False),
               "seq": _u64(required=False), "seal_credit": _event()},
    # ``alloc`` is left out by a client that sends its seal before the (pipelined) create's reply.
    "seal": {"name": _object_name(), "alloc": _u64(required=False), "done_event": _event()},
    # A range of pool memory this session carves objects from itself (a create without waiting).
    "arena": {"pool": _name(), "nbytes": _u64()},
    # ``wake``: no lease, only an answer ({}) once the object exists ("entry": at its create where
    # its seal goes on the board, else at its seal) or is sealed or gone ("seal"): a directory
    # reader whose spin ran out sleeps until then, and reads its pool's directory (``ipcpool.shm``).
    "get": {"name": _object_name(), "timeout_ms": Field(int, False, min_value=0, check=check_wait),
            "wake": Field(str, False, max_len=8, check=check_wake)},
    "get_many": {"names": Field(list, max_len=MAX_BATCH, check=check_names)},
    "delete": {"name": _object_name()},
    # Paged: at most ``limit`` (and LIST_PAGE) entries of each kind whose names sort after ``after``;
    # the reply says ``more`` and the ``after`` to continue from. ``kind``: "objects" or "growables"
    # only (without it both come, and ``after`` continues the objects).
    "list": {"prefix": Field(str, False, max_len=MAX_NAME), "after": Field(str, False, max_len=MAX_NAME),
             "limit": _u64(required=False), "kind": Field(str, False, max_len=16, check=check_kind)},
    "watch": {"prefix": Field(str, True, max_len=MAX_NAME), "existing": Field(bool, False)},
    "unwatch": {"watch": _u64()},
    "grow_create": {"name": _object_name(), "nbytes": _u64(), "pool": _name(), "compression": Field(bool, False)},
    "grow_attach": {"name": _object_name()},
    "grow": {"name": _object_name(), "nbytes": _u64()},
    "grow_detach": {"name": _object_name()},
    "grow_delete": {"name": _object_name()},
    # A lease taken from a pool's name directory ends (``ipcpool.shm.leases``): its slot and nonce,
    # the entry and object it named, and the done event after the reader's last use (R2).
    "release": {"pool_index": _u64(), "entry": _u64(), "gen": _u64(), "slot": _u64(), "nonce": _u64(),
                "done_event": _event()},
    # The export of an allocation a directory entry names (an arena), for a reader to import once.
    "dir_export": {"pool": _name(), "alloc": _u64()},
    # Open sessions (pid, uid, what each holds), LIST_PAGE at most, those of ids above ``after``.
    "sessions": {"after": _u64(required=False)},
}

# Checkpoints (``broker.checkpoints``): a version is begun with its shards' sizes, its manifest added
# in pieces of at most MAX_ARRAY entries, then published (or aborted); readers attach and read the
# manifest in pages.
CKPT_MAX_SHARDS = 256            # allocations of one version
CKPT_MAX_ENTRIES = 1 << 18       # tensors of one version
# Bytes per element of the dtypes a checkpoint may hold: the broker checks every tensor's size.
CKPT_ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "uint32": 4, "int32": 4, "uint64": 8,
    "int64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "float8_e4m3fn": 1,
    "float8_e5m2": 1, "complex64": 8, "complex128": 16,
}


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 63


def check_sizes(key: str, sizes: list) -> None:
    if not sizes or not all(_count(n) and n > 0 for n in sizes):
        raise InvalidRequest(f"{key}: 1 to {CKPT_MAX_SHARDS} positive sizes in bytes")


def check_user(key: str, user: dict) -> None:
    check_meta(key, {"user": user})


def check_events(key: str, events: list) -> None:
    for i, e in enumerate(events):
        if not isinstance(e, bytes):
            raise InvalidRequest(f"{key}[{i}]: an event handle is bytes")
        check_event(f"{key}[{i}]", e)


def check_ids(key: str, ids: list) -> None:
    if not ids:
        raise InvalidRequest(f"{key}: at least one id")
    for i, v in enumerate(ids):
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << 64:
            raise InvalidRequest(f"{key}[{i}]: an id is an int in [0, 2**64)")


def check_indices(key: str, indices: list) -> None:
    for i, v in enumerate(indices):
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < CKPT_MAX_SHARDS:
            raise InvalidRequest(f"{key}[{i}]: a shard index in [0, {CKPT_MAX_SHARDS})")


def check_entries(key: str, entries: list) -> None:
    """Manifest entries ``[name, dtype, shape, shard, offset, nbytes]``: types, a known dtype, a
    size that matches dtype and shape, an aligned offset (the shard bounds are the table's)."""
    for i, e in enumerate(entries):
        where = f"{key}[{i}]"
        if not isinstance(e, list) or len(e) != 6:
            raise InvalidRequest(f"{where}: [name, dtype, shape, shard, offset, nbytes]")
        name, dtype, shape, shard, offset, nbytes = e
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME or not name.isprintable():
            raise InvalidRequest(f"{where}: a tensor name is 1-{MAX_NAME} printable characters")
        itemsize = CKPT_ITEMSIZE.get(dtype) if isinstance(dtype, str) else None
        if itemsize is None:
            raise InvalidRequest(f"{where}: dtype {_show(dtype, 32)} is not one of {', '.join(CKPT_ITEMSIZE)}")
        if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_count(d) for d in shape):
            raise InvalidRequest(f"{where}: a shape is a list of at most {MAX_DIMS} non-negative ints")
        if not (_count(shard) and _count(offset) and _count(nbytes)):
            raise InvalidRequest(f"{where}: shard, offset and nbytes are non-negative ints")
        count = 1
        for d in shape:
            count *= d
            if count * itemsize > nbytes:
                break
        if count * itemsize != nbytes:
            raise InvalidRequest(f"{where}: {name[:80]!r} is {dtype} {shape}"[:200] + f", not {nbytes} bytes")
        if offset % itemsize:
            raise InvalidRequest(f"{where}: offset {offset} is not aligned to {dtype}")


REQUESTS.update({
    # ``exclusive``: elect one loader. Where the checkpoint has a current version or a live writer,
    # nothing is made and the reply says ``busy`` (with ``current``) instead.
    "ckpt_begin": {"name": _object_name(), "shards": Field(list, max_len=CKPT_MAX_SHARDS, check=check_sizes),
                   "count": _u64(), "pool": _name(),
                   "user": Field(dict, False, check=check_user), "exclusive": Field(bool, False)},
    "ckpt_add": {"name": _object_name(), "version": _u64(), "entries": Field(list, max_len=MAX_ARRAY, check=check_entries)},
    # ``done_events``: one per shard (the writer's release of its import), or none (host).
    # ``keep``: the indices of the shards the writer keeps mapped (held by its keeper).
    "ckpt_publish": {"name": _object_name(), "version": _u64(),
                     "done_events": Field(list, False, max_len=CKPT_MAX_SHARDS, check=check_events),
                     "keep": Field(list, False, max_len=CKPT_MAX_SHARDS, check=check_indices)},
    # One way: kept shards the writer unmapped (their allocation ids).
    "ckpt_unkeep": {"allocs": Field(list, True, max_len=MAX_ARRAY, check=check_ids)},
    "ckpt_abort": {"name": _object_name(), "version": _u64()},
    # The current version (or ``version``); with ``newer_than``: ``same`` where the current is no newer.
    "ckpt_attach": {"name": _object_name(), "version": _u64(required=False), "newer_than": _u64(required=False)},
    "ckpt_manifest": {"name": _object_name(), "version": _u64(), "start": _u64()},
    "ckpt_list": {"prefix": Field(str, False, max_len=MAX_NAME), "after": Field(str, False, max_len=MAX_NAME),
                  "limit": _u64(required=False)},
    "ckpt_delete": {"name": _object_name()},
})

# One-way requests: the broker acts and sends no reply (ordering per session is kept by ZeroMQ).
ONE_WAY = frozenset({"free", "ack", "ckpt_unkeep"})

# FDs in one control reply at most (the kernel's own limit, SCM_MAX_FD, is 253): a batch attach
# of 64 GiB in VMM slabs of 1 GiB fetches them all in one reply.
FD_BATCH = 64


# Requests on the control socket.
CONTROL: dict[str, dict[str, Field]] = {
    "hello": {"version": _u64(), "pid": _u64(required=False)},
    "pool_fd": {"pool": _name()},
    # The chunk FDs of a growable buffer (from chunk ``first``) or of a VMM-backed allocation.
    "chunk_fds": {"growable": _object_name(required=False), "alloc": _u64(required=False), "first": _u64()},
    # Every chunk FD of each allocation named (FD_BATCH in all at most), in order: how a batch
    # attach fetches the FDs of the VMM slabs it lacks in one round trip, not one per slab.
    "alloc_fds": {"allocs": Field(list, True, max_len=FD_BATCH, check=check_ids)},
    # The growable buffer ops of the message channel, answered here with the FDs of the chunks from
    # ``first`` (those the client has not mapped) in the same reply: one round trip each.
    "grow_create": {**REQUESTS["grow_create"]},
    "grow_attach": {**REQUESTS["grow_attach"]},
    # ``loan``: chunks lent to this session (ipcpool.broker.loans) to grow by, if the buffer still
    # has ``first`` chunks; the reply says ``took`` (else it grew as without them).
    "grow": {**REQUESTS["grow"], "first": _u64(required=False),
             "loan": Field(list, False, max_len=FD_BATCH, check=check_ids)},
    # The size and chunks a growable has now, with the FDs from ``first``: how a process whose
    # backend cannot see a grow by itself (CUDA) follows one without waiting for its notice (and
    # only once its word on the growth board changed: see ipcpool.shm.growboard).
    "grow_sync": {"name": _object_name(), "first": _u64(required=False)},
}
# Each schema's field names with "op" and "id" (and ``read``: the bytes the client has taken in
# from the message channel, on any request there): a message may carry no other (see validate).
_COMMON = frozenset({"op", "id", "read"})
_ALLOWED = {id(schema): frozenset(schema) | _COMMON for table in (REQUESTS, CONTROL) for schema in table.values()}
_PLANS: dict[int, tuple] = {}   # filled below, once every schema is defined

# Every reply about a growable names its ``word`` on the growth board (-1: none) and the ``stamp``
# that word holds; a session's first reply of GROWABLE_CONTROL also says ``board``: its first FD
# is the board's.
GROWABLE_CONTROL = frozenset({"grow_create", "grow_attach", "grow", "grow_sync"})


def _show(value: Any, limit: int = 64) -> str:
    """``repr(value)`` cut to ``limit`` characters: an error never echoes a long input back."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _kind_name(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__


def validate(msg: dict, schemas: dict[str, dict[str, Field]]) -> tuple[str, dict[str, Any]]:
    """Check a decoded message against its op's schema; return (op, fields). Every way a message
    can be wrong is a ProtocolError (or InvalidRequest) naming the field; nothing else escapes."""
    if not isinstance(msg, dict):
        raise ProtocolError(f"message must be a map, got {type(msg).__name__}")
    # msgpack admits str and bytes keys: a bytes key (or a mix of both) is refused here, before
    # anything compares keys of different types.
    bad_keys = [k for k in msg if not isinstance(k, str)]
    if bad_keys:
        raise ProtocolError(f"field names must be strings, got {_show(bad_keys[0])}")
    op = msg.get("op")
    if not isinstance(op, str) or op not in schemas:
        raise ProtocolError(f"unknown op {_show(op)}")
    schema = schemas[op]
    allowed = _ALLOWED.get(id(schema))
    if allowed is None:
        allowed = frozenset(schema) | _COMMON
    if not allowed.issuperset(msg):
        extra = set(msg) - allowed
        shown = ", ".join(_show(k, 40) for k in sorted(extra)[:5])
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise ProtocolError(f"{op}: unexpected fields {shown}{more}")
    if "id" in msg:
        check_id(msg["id"])
    plan = _PLANS.get(id(schema))
    if plan is None:
        plan = _plan(schema)
    fields: dict[str, Any] = {}
    # (one tuple per field, unpacked: a create, the hand-off's first message, is checked on the
    # way to its directory entry, where attribute reads per field cost µs)
    for key, required, kind, is_int, max_len, min_value, check in plan:
        value = msg.get(key)
        if value is None:
            if required:
                raise ProtocolError(f"{op}: missing field {key!r}")
            continue
        # bool is an int in Python; never accept it where a number is meant.
        if not isinstance(value, kind) or (is_int and isinstance(value, bool)):
            raise ProtocolError(f"{op}: field {key!r} must be {_kind_name(kind)}, got {type(value).__name__}")
        if max_len is not None and len(value) > max_len:
            raise ProtocolError(f"{op}: field {key!r} longer than {max_len}")
        if min_value is not None and value < min_value:
            raise ProtocolError(f"{op}: field {key!r} must be >= {min_value}")
        if is_int and value >= 1 << 64:
            raise ProtocolError(f"{op}: field {key!r} out of range")
        if check is not None:
            check(key, value)
        fields[key] = value
    return op, fields


def _plan(schema: dict[str, Field]) -> tuple:
    return tuple((key, spec.required, spec.kind, spec.kind is int, spec.max_len, spec.min_value, spec.check)
                 for key, spec in schema.items())


def check_id(rid: Any) -> int:
    """A request id: an int in [0, 2**63), not a bool. Anything else is refused (and answered with
    id 0), never executed."""
    if not isinstance(rid, int) or isinstance(rid, bool):
        raise ProtocolError(f"field 'id' must be int, got {type(rid).__name__}")
    if not 0 <= rid < MAX_ID:
        raise ProtocolError(f"field 'id' must be in [0, 2**63), got {_show(rid)}")
    return rid


def request_id(msg: dict) -> int:
    """The id to answer with: the request's own where it is a valid one, else 0."""
    rid = msg.get("id", 0) if isinstance(msg, dict) else 0
    return rid if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid < MAX_ID else 0


def ok_reply(rid: int, **fields) -> dict:
    return {"id": rid, "ok": True, **fields}


def error_reply(rid: int, exc: IpcPoolError) -> dict:
    text = str(exc)
    if len(text) > MAX_ERROR:   # every reply stays decodable by the client (MAX_STR)
        text = text[: MAX_ERROR - 3] + "..."
    return {"id": rid, "ok": False, "code": exc.code, "error": text}


def refusal(reply: dict) -> IpcPoolError:
    """The error an error reply (``error_reply``) reports, rebuilt."""
    return error_from_wire(reply.get("code", 1), str(reply.get("error", "unknown error")))


_PLANS.update({id(schema): _plan(schema) for table in (REQUESTS, CONTROL) for schema in table.values()})
