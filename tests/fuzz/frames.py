"""The frames the fuzz sends: requests valid, malformed by construction, or either (a bit flip),
for the message channel and the control socket. Each kind is named; one seeded ``random.Random``
drives them all, so a run can be replayed."""

from __future__ import annotations

import os
import random

import msgpack

from ipcpool import protocol
from ipcpool.errors import IpcPoolError

NAMES = ["fz/a", "fz/b", "fz/c", "fz/d/e", "fz/g"]

# Kinds whose frames are malformed by construction: any ``ok`` reply to one is a failure.
MALFORMED = {"random", "truncated", "wrong_type", "missing", "extra", "mixed_keys", "bytes_keys",
             "unknown_op", "long_op", "bad_id", "no_id", "multiframe", "not_a_map", "nested"}
# ... and "oversized" (over MAX_MESSAGE: dropped with the connection, never answered), sent alone.
# Kinds that may or may not be valid (checked with the protocol's own validator) or are valid.
OTHER = {"bitflip", "huge", "valid"}
ZMQ_KINDS = sorted(MALFORMED | OTHER)
CONTROL_KINDS = ["random", "bitflip", "truncated", "wrong_type", "missing", "extra", "mixed_keys",
                 "unknown_op", "long_op", "bad_id", "not_a_map", "oversized", "with_fds", "nested",
                 "in_session"]


# -- the message channel ----------------------------------------------------------------------------
def _rand_value(rng: random.Random, depth: int = 0):
    pick = rng.randrange(12 if depth < 2 else 9)
    return [
        lambda: rng.randint(-(1 << 63), (1 << 64) - 1),
        lambda: rng.choice([0, 1, -1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]),
        lambda: rng.random() * 10 ** rng.randint(-5, 30),
        lambda: rng.choice([True, False, None]),
        lambda: "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randint(0, 40))),
        lambda: rng.randbytes(rng.randint(0, 80)),
        lambda: rng.choice(NAMES),
        lambda: "x" * rng.choice([256, 1000, 4096]),
        lambda: rng.randbytes(rng.choice([64, 65, 1024])),
        lambda: [_rand_value(rng, depth + 1) for _ in range(rng.randint(0, 5))],
        lambda: {str(rng.randrange(100)): _rand_value(rng, depth + 1) for _ in range(rng.randint(0, 4))},
        lambda: {"dtype": _rand_value(rng, depth + 1), "shape": _rand_value(rng, depth + 1)},
    ][pick]()


def _valid_value(rng: random.Random, op: str, key: str, spec: protocol.Field):
    if key in ("name",):
        return rng.choice(NAMES)
    if key == "names":
        return rng.sample(NAMES, rng.randint(1, 3))
    if key in ("pool",):
        return rng.choice(["default", "default", "nope"])
    if key == "prefix":
        return rng.choice(["", "fz/", "fz/d/", "zz"])
    if key == "meta":
        return rng.choice([{}, {"dtype": "float32", "shape": [4, 4]}, {"user": {"k": "v", "n": 3}}])
    if key == "timeout_ms":
        return rng.choice([0, 1, 5, 20])
    if key in ("nbytes", "bytes", "keep"):
        return rng.choice([1, 4096, 1 << 20, rng.randint(1, 1 << 22)])
    if key == "growable":
        return rng.choice(NAMES)
    if spec.kind is int:
        return rng.choice([0, 1, 2, 3, rng.randint(0, 1 << 20)])
    if spec.kind is bool:
        return rng.random() < 0.5
    if spec.kind is bytes:
        n = spec.max_len or 16
        return rng.randbytes(rng.choice([0, n]))
    if spec.kind is str:
        return rng.choice(NAMES)
    if spec.kind is list:
        return rng.sample(NAMES, 2)
    if spec.kind is dict:
        return {}
    return None


def _huge_value(rng: random.Random, op: str, key: str, spec: protocol.Field):
    if key == "pool" or rng.random() < 0.3:   # the other fields valid: the huge one reaches the handler
        return _valid_value(rng, op, key, spec)
    if spec.kind is int:
        return rng.choice([(1 << 64) - 1, 1 << 63, (1 << 63) - 1, 1 << 62, 1 << 40, 1 << 33])
    if key in ("name", "growable"):
        return "h" + "/h" * rng.randint(1, 126)
    if spec.kind is str:
        return "p" * rng.choice([64, 255])
    if key == "names":
        return [f"n{i}" for i in range(rng.choice([1, 100, protocol.MAX_BATCH]))]
    return _valid_value(rng, op, key, spec)


def _wrong_value(rng: random.Random, spec: protocol.Field):
    """A value of a type the field does not accept (never None: that means absent)."""
    kinds = spec.kind if isinstance(spec.kind, tuple) else (spec.kind,)
    while True:
        v = rng.choice([-1, -(1 << 63), 1.5, float("nan"), True, False, "7", b"7", [1], {"a": 1},
                        "x" * 300, b"\x00" * 65, -5])
        if isinstance(v, bool) and (bool in kinds):
            continue
        if isinstance(v, int) and not isinstance(v, bool) and int in kinds and v >= 0:
            continue
        if not isinstance(v, kinds) or (int in kinds and isinstance(v, bool)) or (
                int in kinds and isinstance(v, int) and v < 0):
            return v


def request(rng: random.Random, schemas: dict, op: str | None = None, how=_valid_value) -> dict:
    op = op or rng.choice(sorted(schemas))
    msg = {"op": op}
    for key, spec in schemas[op].items():
        if spec.required or rng.random() < 0.5:
            v = how(rng, op, key, spec)
            if v is not None:
                msg[key] = v
    return msg


def zmq_frame(rng: random.Random, kind: str, rid: int) -> list[bytes]:
    """One malformed (or, for the OTHER kinds, possibly valid) request as ZeroMQ frames."""
    R = protocol.REQUESTS
    if kind == "random":
        data = rng.randbytes(rng.randint(0, 300))
        if data[:1] and 0x80 <= data[0] <= 0x8F:
            data = b"\xc1" + data   # (a random map could be valid: keep random bytes malformed)
        return [data]
    if kind == "valid":
        return [protocol.pack({**request(rng, R), "id": rid})]
    if kind == "huge":
        return [protocol.pack({**request(rng, R, how=_huge_value), "id": rid})]
    if kind == "bitflip":
        data = bytearray(protocol.pack({**request(rng, R), "id": rid}))
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return [bytes(data)]
    if kind == "truncated":
        data = protocol.pack({**request(rng, R), "id": rid})
        return [data[: rng.randrange(len(data))]]
    if kind == "not_a_map":
        return [msgpack.packb(rng.choice([[1, 2], "allocate", 5, None, b"x", [{"op": "ping", "id": rid}]]))]
    if kind == "multiframe":
        one = protocol.pack({"op": "ping", "id": rid})
        return [one] * rng.randint(2, 3) if rng.random() < 0.5 else [one, b""]
    if kind == "no_id":
        return [protocol.pack(request(rng, R))]
    msg = {**request(rng, R), "id": rid}
    op = msg["op"]
    if kind == "wrong_type":
        key = rng.choice(sorted(R[op]) + ["op"]) if R[op] else "op"
        msg[key] = _wrong_value(rng, R[op][key]) if key != "op" else rng.choice([5, None, b"ping", ["ping"]])
    elif kind == "missing":
        required = [k for k, s in R[op].items() if s.required]
        if not required:   # an op without required fields: drop the op itself
            del msg["op"]
        else:
            msg.pop(rng.choice(required), None)
    elif kind == "extra":
        msg[rng.choice(["evil", "x" * 200, "ID", "Op", "pid", "timeout"])] = _rand_value(rng)
    elif kind == "mixed_keys":
        msg[rng.choice([b"b", b"op", b"id"])] = _rand_value(rng)
    elif kind == "bytes_keys":
        msg = {k.encode(): v for k, v in msg.items()}
    elif kind == "unknown_op":
        msg["op"] = rng.choice(["launch_missiles", "", "ALLOCATE", "op_allocate", "__init__", "handle",
                                "hello", "pool_fd", "allocate\x00"])
    elif kind == "long_op":
        msg["op"] = "Z" * rng.choice([100, 1000, protocol.MAX_STR])
    elif kind == "bad_id":
        msg["id"] = rng.choice([-1, "1", None, 1.0, True, False, 1 << 63, (1 << 64) - 1, b"\x01", [1], {"a": 1}])
    elif kind == "nested":
        deep: object = 1
        for _ in range(rng.randint(10, 200)):
            deep = [deep]
        msg[rng.choice(sorted(R[op]) or ["x"]) if R[op] else "x"] = deep
        if R[op] and rng.random() < 0.5 and "meta" in R[op]:
            msg["meta"] = {"user": {"k": deep}}
    return [protocol.pack(msg)]


def locally_malformed(frames: list[bytes]) -> bool:
    """What the protocol's own checks say of a frame whose validity is not known by construction."""
    if len(frames) != 1:
        return True
    try:
        msg = protocol.unpack(frames[0])
        rid = msg.get("id")
        if not isinstance(rid, int) or isinstance(rid, bool) or not 0 <= rid < 1 << 63:
            return True   # (checked here, not by the broker's code: an id is part of the contract)
        if any(not isinstance(k, str) for k in msg):
            return True
        protocol.validate(msg, protocol.REQUESTS)
    except IpcPoolError:
        return True
    return False


# -- the control socket -----------------------------------------------------------------------------
def control_payload(rng: random.Random, kind: str) -> tuple[bytes, list[int], bool]:
    """(datagram, FDs to attach, malformed by construction) for a fresh connection's first message."""
    C = protocol.CONTROL
    hello = {"op": "hello", "version": protocol.PROTOCOL_VERSION, "pid": os.getpid()}
    if kind == "random":
        data = rng.randbytes(rng.randint(1, 300))
        return (b"\xc1" + data if 0x80 <= data[0] <= 0x8F else data), [], True
    if kind == "bitflip":
        data = bytearray(protocol.pack(hello))
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data), [], None   # decided by the protocol's checks
    if kind == "truncated":
        data = protocol.pack(hello)
        return data[: rng.randrange(1, len(data))], [], True
    if kind == "not_a_map":
        return msgpack.packb(rng.choice([[hello], "hello", 1, None])), [], True
    if kind == "oversized":
        return protocol.pack({**hello, "pad": b"\x00" * 100}) + b"\x00" * (protocol.MAX_MESSAGE + rng.randint(0, 5000)), [], True
    if kind == "with_fds":
        r, w = os.pipe()
        return protocol.pack(hello), [r, w], True
    if kind == "nested":
        deep: object = 1
        for _ in range(rng.randint(10, 300)):
            deep = {"a": deep} if rng.random() < 0.5 else [deep]
        return protocol.pack({**hello, "pid": deep}), [], True
    msg = dict(hello)
    if kind == "wrong_type":
        key = rng.choice(["version", "pid", "op"])
        msg[key] = _wrong_value(rng, C["hello"][key]) if key != "op" else rng.choice([1, None, b"hello"])
    elif kind == "missing":
        del msg[rng.choice(["version", "op"])]
    elif kind == "extra":
        msg[rng.choice(["a", "evil", "z" * 300])] = _rand_value(rng)
    elif kind == "mixed_keys":   # the datagram, and variants
        msg["a"] = 1
        msg[rng.choice([b"b", b"op", b"version"])] = 2
    elif kind == "unknown_op":
        msg["op"] = rng.choice(["helo", "HELLO", "", "allocate", "chunk_fds", "pool_fd"])
    elif kind == "long_op":
        msg["op"] = "H" * rng.choice([300, protocol.MAX_STR])
    elif kind == "bad_id":
        msg["id"] = rng.choice([-1, "1", None, 1.5, True, 1 << 63, (1 << 64) - 1, b"\x01"])
    return protocol.pack(msg), [], True


def session_payload(rng: random.Random) -> tuple[bytes, bool, bool]:
    """(datagram, malformed, ends the session) for a message inside an open session."""
    C = protocol.CONTROL
    pick = rng.randrange(8)
    if pick == 0:
        return rng.randbytes(rng.randint(1, 100)) + b"\xc1", True, True
    if pick == 1:
        return protocol.pack({"op": "pool_fd", "pool": "default", b"x": 1}), True, False
    if pick == 2:
        return protocol.pack({"op": "chunk_fds", "first": rng.choice([-1, "0", 1.5, True])}), True, False
    if pick == 3:
        return protocol.pack({"op": "hello", "version": 1}), True, False
    if pick == 4:
        return protocol.pack({"op": "pool_fd", "pool": "default", "id": rng.choice([-1, "x", 1 << 63, None])}), True, False
    if pick == 5:
        return protocol.pack({"op": "Q" * 4000}), True, False
    if pick == 6:   # valid (the answer may be an error: nothing of that name)
        msg = request(rng, C, rng.choice(["pool_fd", "chunk_fds"]))
        return protocol.pack({**msg, "id": rng.randrange(1 << 20)}), False, False
    msg = request(rng, C, rng.choice(["pool_fd", "chunk_fds"]), how=_huge_value)
    return protocol.pack(msg), None, False
