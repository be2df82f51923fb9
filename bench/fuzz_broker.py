"""Fuzz a running broker with malformed frames on both sockets, and check how it answers.

Seeded, so a failing run can be replayed. On the message channel (one raw session) it sends
frames of every kind: random bytes, bit-flipped and truncated requests, wrong field types,
missing and extra fields, str/bytes key mixes, unknown and over-long ops, bad ids (-1, nil, a
string, a float, a bool, >= 2**63), extra frames, deep nesting, huge values, and valid requests
among them. On the control socket it sends hellos of the same kinds on fresh connections (some
with FDs attached or over the size limit) and bad messages inside open sessions.

After every batch the broker must still serve (a ping on the fuzzed session, and on control
batches a fresh client's stats); over the whole run there must be no internal-error reply, no
``ok`` reply to a request malformed by construction (or refused by the protocol's own checks),
and no reply a client cannot decode (``protocol.unpack`` with the client's limits).

    python bench/fuzz_broker.py                                   # 100k ZeroMQ + 10k control frames
    python bench/fuzz_broker.py --zmq 5000 --control 500 --seed 7
    python bench/fuzz_broker.py --socket-dir /run/ipcpool         # a broker that is running already

The test suite runs a small seeded run (tests/integration/test_fuzz.py).
"""

from __future__ import annotations

import argparse
import array
import json
import os
import random
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgpack  # noqa: E402
import zmq  # noqa: E402

import ipcpool  # noqa: E402
from ipcpool import fdpass, protocol  # noqa: E402
from ipcpool.errors import InternalError, IpcPoolError  # noqa: E402
from ipcpool.progress import Progress  # noqa: E402

INTERNAL = "internal broker error"   # how a broker bug's reply begins (older brokers: code 1)
NAMES = ["fz/a", "fz/b", "fz/c", "fz/d/e", "fz/g"]
BARRIER = 1 << 62   # ids of the pings that close each batch (fuzzed ids stay below)

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


@dataclass
class Summary:
    seed: int
    zmq_frames: int = 0
    zmq_replies: int = 0
    control_frames: int = 0
    control_replies: int = 0
    batches: int = 0
    alive_checks: int = 0
    by_kind: dict = field(default_factory=dict)
    ok_to_valid: int = 0
    error_replies: int = 0
    internal_errors: list = field(default_factory=list)
    ok_to_malformed: list = field(default_factory=list)
    undecodable: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failures(self) -> int:
        return len(self.internal_errors) + len(self.ok_to_malformed) + len(self.undecodable)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        for k in ("internal_errors", "ok_to_malformed", "undecodable"):
            d[k] = len(d[k])
            d[f"{k}_examples"] = [repr(x)[:300] for x in getattr(self, k)[:5]]
        return d


class BrokerDown(AssertionError):
    """The broker stopped serving during the run."""


def is_internal(reply: dict) -> bool:
    """A reply that reports a broker bug rather than a refusal of the request."""
    return reply.get("code") == InternalError.code or INTERNAL in str(reply.get("error", ""))


# -- frame generators ---------------------------------------------------------------------------------
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


# -- the message channel ------------------------------------------------------------------------------
class RawSession:
    """A session opened by hand: its control socket and a DEALER with its token."""

    def __init__(self, socket_dir: Path, zctx: zmq.Context):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.sock.settimeout(10)
        self.sock.connect(str(Path(socket_dir) / "broker.sock"))
        fdpass.send(self.sock, {"op": "hello", "version": protocol.PROTOCOL_VERSION})
        got = fdpass.recv(self.sock)
        if got is None or not got[0].get("ok"):
            raise BrokerDown(f"hello refused: {got}")
        self.hello = got[0]
        self.dealer = dealer(zctx, self.hello["token"], self.hello["endpoint"])

    def bye(self) -> None:
        """End the session now (the broker ends it at once even after it dropped the control socket)."""
        try:
            self.dealer.send(protocol.pack({"op": "bye", "id": BARRIER - 1}))
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                reply = protocol.unpack(self.dealer.recv(), protocol.MAX_REPLY)
                if reply.get("id") == BARRIER - 1:
                    break
        except zmq.Again:
            pass
        finally:
            self.dealer.close(linger=0)
            self.sock.close()


def dealer(zctx: zmq.Context, token: bytes, endpoint: str) -> zmq.Socket:
    d = zctx.socket(zmq.DEALER)
    d.setsockopt(zmq.IDENTITY, token)
    d.setsockopt(zmq.RCVTIMEO, 10_000)
    d.setsockopt(zmq.LINGER, 0)
    d.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_REPLY)
    d.connect(endpoint)
    return d


class Checker:
    def __init__(self, summary: Summary):
        self.s = summary
        self.malformed: dict[int, str] = {}   # request id -> kind, for requests malformed by construction
        self.valid_id0 = 0                     # frames the validator accepts with id 0 (in this batch)

    def reply(self, data: bytes, where: str) -> dict | None:
        try:
            reply = protocol.unpack(data, protocol.MAX_REPLY)
        except IpcPoolError as exc:
            self.s.undecodable.append((where, str(exc)[:200], data[:100]))
            return None
        if "notify" in reply:
            return reply
        if reply.get("ok"):
            rid = reply.get("id")
            kind = self.malformed.get(rid) if rid != 0 else (None if self.valid_id0 else "id 0")
            if kind is not None:
                self.s.ok_to_malformed.append((where, kind, rid))
            else:
                self.s.ok_to_valid += 1
        else:
            self.s.error_replies += 1
            if is_internal(reply):
                self.s.internal_errors.append((where, reply.get("error")))
        return reply


def fuzz_zmq(rng: random.Random, sess: RawSession, checker: Checker, frames: int, batch: int, progress) -> None:
    s = checker.s
    sent = 0
    n_batch = 0
    while sent < frames:
        checker.valid_id0 = 0
        for _ in range(min(batch, frames - sent)):
            kind = rng.choice(ZMQ_KINDS)
            rid = rng.randrange(1, BARRIER - 2)
            parts = zmq_frame(rng, kind, rid)
            if kind in MALFORMED or locally_malformed(parts):
                checker.malformed[rid] = kind
            elif kind == "bitflip":
                msg = protocol.unpack(parts[0])
                if msg.get("id") == 0:
                    checker.valid_id0 += 1
                else:
                    checker.malformed.pop(msg.get("id"), None)
            s.by_kind[kind] = s.by_kind.get(kind, 0) + 1
            sess.dealer.send_multipart(parts)
            sent += 1
        n_batch += 1
        barrier = BARRIER + n_batch
        sess.dealer.send(protocol.pack({"op": "ping", "id": barrier}))
        while True:
            try:
                data = sess.dealer.recv()
            except zmq.Again:
                raise BrokerDown(f"no answer to the ping after batch {n_batch} ({sent} frames)") from None
            reply = checker.reply(data, "zmq")
            if reply is None or "notify" in reply:
                continue
            s.zmq_replies += 1
            if reply.get("id") == barrier:
                if not reply.get("ok"):
                    raise BrokerDown(f"the ping after batch {n_batch} failed: {reply}")
                s.zmq_replies -= 1
                break
        if rng.random() < 0.05 and sent < frames:   # a frame over the size limit, on its own
            oversized(rng, sess, checker, n_batch)
            sent += 1
        s.zmq_frames = sent
        s.batches += 1
        s.alive_checks += 1
        progress(0, sent)


def oversized(rng: random.Random, sess: RawSession, checker: Checker, n_batch: int) -> None:
    """A frame over MAX_MESSAGE: libzmq drops the connection without a reply, the DEALER connects
    again by itself, and the session goes on (pings until one is answered)."""
    s = checker.s
    s.by_kind["oversized"] = s.by_kind.get("oversized", 0) + 1
    sess.dealer.send(b"\x81\xa2op" + rng.randbytes(protocol.MAX_MESSAGE + rng.randint(1, 4096)))
    sess.dealer.setsockopt(zmq.RCVTIMEO, 200)
    try:
        pings = set()
        deadline = time.monotonic() + 15
        while True:
            if time.monotonic() > deadline:
                raise BrokerDown(f"no answer after an oversized frame (batch {n_batch})")
            ping = BARRIER + (1 << 40) + n_batch * 1000 + len(pings)
            pings.add(ping)
            sess.dealer.send(protocol.pack({"op": "ping", "id": ping}))
            try:
                while True:
                    reply = checker.reply(sess.dealer.recv(), "zmq")
                    if reply is not None and reply.get("id") in pings and reply.get("ok"):
                        return
            except zmq.Again:
                continue
    finally:
        sess.dealer.setsockopt(zmq.RCVTIMEO, 10_000)


# -- the control socket -------------------------------------------------------------------------------
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


def _control_replies(checker: Checker, sock: socket.socket, malformed: bool | None, payload: bytes,
                     one: bool = False) -> list[dict]:
    """Every reply up to EOF (``one``: the first reply); closes the FDs that come with them."""
    out = []
    sock.settimeout(5.0)
    while True:
        try:
            data, anc, _flags, _ = sock.recvmsg(protocol.MAX_REPLY, socket.CMSG_SPACE(64 * 4))
        except (TimeoutError, socket.timeout):
            break
        except OSError:
            break
        for level, kind, payload_fds in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                arr = array.array("i")
                arr.frombytes(payload_fds[: len(payload_fds) - len(payload_fds) % 4])
                for fd in arr:
                    os.close(fd)
        if not data:
            break
        checker.s.control_replies += 1
        try:
            reply = protocol.unpack(data, protocol.MAX_REPLY)
        except IpcPoolError as exc:
            checker.s.undecodable.append(("control", str(exc)[:200], data[:100]))
            continue
        if reply.get("ok"):
            if malformed is None:
                try:
                    op, _ = protocol.validate(protocol.unpack(payload), protocol.CONTROL)
                    malformed = False
                except IpcPoolError:
                    malformed = True
            if malformed:
                checker.s.ok_to_malformed.append(("control", payload[:80], reply))
            else:
                checker.s.ok_to_valid += 1
        else:
            checker.s.error_replies += 1
            if is_internal(reply):
                checker.s.internal_errors.append(("control", reply.get("error")))
        out.append(reply)
        if one or (reply.get("ok") and "token" in reply):
            break   # one answer to a message in a session; or a session opened (a hello that survived its bit flips): the caller ends it
    return out


def fuzz_control(rng: random.Random, socket_dir: Path, zctx: zmq.Context, checker: Checker,
                 frames: int, batch: int, progress) -> None:
    s = checker.s
    path = str(Path(socket_dir) / "broker.sock")
    sent = 0
    while sent < frames:
        for _ in range(min(batch, frames - sent)):
            kind = rng.choice(CONTROL_KINDS)
            s.by_kind[f"control:{kind}"] = s.by_kind.get(f"control:{kind}", 0) + 1
            if kind == "in_session":
                sess = RawSession(socket_dir, zctx)
                try:
                    for _ in range(rng.randint(1, 5)):
                        payload, malformed, ends = session_payload(rng)
                        sess.sock.send(payload)
                        sent += 1
                        _control_replies(checker, sess.sock, malformed, payload, one=not ends)
                        if ends:
                            break
                finally:
                    sess.bye()
                continue
            payload, fds, malformed = control_payload(rng, kind)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            try:
                sock.settimeout(10)
                sock.connect(path)
                try:
                    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
                    sock.sendmsg([payload], anc)
                except OSError:   # EMSGSIZE: the kernel refuses a datagram over the socket's limit
                    pass
                sent += 1
                replies = _control_replies(checker, sock, malformed, payload)
                opened = [r for r in replies if r.get("ok") and "token" in r]
                if opened:   # end that session cleanly
                    d = dealer(zctx, opened[0]["token"], opened[0]["endpoint"])
                    d.send(protocol.pack({"op": "bye", "id": 1}))
                    try:
                        d.recv()
                    except zmq.Again:
                        pass
                    d.close(linger=0)
            finally:
                sock.close()
                for fd in fds:
                    os.close(fd)
        alive(socket_dir)
        s.control_frames = sent
        s.batches += 1
        s.alive_checks += 1
        progress(0, sent)


def alive(socket_dir: Path) -> None:
    try:
        with ipcpool.connect(socket_dir, timeout=10, arena_bytes=0) as c:
            c.stats()
    except IpcPoolError as exc:
        raise BrokerDown(f"the broker no longer serves a fresh client: {exc}") from exc


def fuzz(socket_dir: Path, *, seed: int = 12, zmq_frames: int = 100_000, control_frames: int = 10_000,
         batch: int = 250, show_progress: bool = False, broker_pid: int | None = None) -> Summary:
    """Run the fuzz against the broker serving ``socket_dir``; the summary says what it found."""
    rng = random.Random(seed)
    summary = Summary(seed)
    checker = Checker(summary)
    zctx = zmq.Context()
    t0 = time.monotonic()
    bars = []
    try:
        for label, total, run in (
            ("ZeroMQ frames", zmq_frames, lambda p: fuzz_zmq(rng, sess, checker, zmq_frames, batch, p)),
            ("control frames", control_frames,
             lambda p: fuzz_control(rng, socket_dir, zctx, checker, control_frames, max(1, batch // 10), p)),
        ):
            if total <= 0:
                continue
            bar = Progress(label, total) if show_progress else None
            bars.append(bar)
            last = [0]

            def progress(_n, done, bar=bar, last=last):
                if broker_pid is not None and not _pid_alive(broker_pid):
                    raise BrokerDown(f"broker pid {broker_pid} exited")
                if bar is not None:
                    bar.update(done - last[0])
                    last[0] = done

            sess = RawSession(socket_dir, zctx)
            try:
                run(progress)
            finally:
                sess.bye()
                if bar is not None:
                    bar.close()
        alive(socket_dir)
    finally:
        zctx.term()
        summary.seconds = round(time.monotonic() - t0, 2)
    return summary


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # a zombie child is gone too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--zmq", type=int, default=100_000, help="frames on the message channel")
    ap.add_argument("--control", type=int, default=10_000, help="frames on the control socket")
    ap.add_argument("--seed", type=int, default=12)
    ap.add_argument("--batch", type=int, default=250, help="frames between two liveness checks")
    ap.add_argument("--socket-dir", help="fuzz the broker serving this directory (default: start one)")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args()

    def run(socket_dir, pid=None):
        return fuzz(Path(socket_dir), seed=args.seed, zmq_frames=args.zmq, control_frames=args.control,
                    batch=args.batch, show_progress=True, broker_pid=pid)

    if args.socket_dir:
        summary = run(args.socket_dir)
    else:
        from bench.common import broker

        with broker("host") as socket_dir:
            summary = run(socket_dir)
    d = summary.as_dict()
    if args.json:
        print(json.dumps(d, indent=2))
    else:
        print(f"seed {d['seed']}: {d['zmq_frames']} ZeroMQ frames ({d['zmq_replies']} replies), "
              f"{d['control_frames']} control frames ({d['control_replies']} replies) in {d['seconds']} s, "
              f"{d['batches']} batches, broker alive after each")
        print(f"  error replies {d['error_replies']}, ok replies to valid requests {d['ok_to_valid']}")
        print(f"  internal errors {d['internal_errors']}, ok to malformed {d['ok_to_malformed']}, "
              f"undecodable replies {d['undecodable']}")
        for k in ("internal_errors", "ok_to_malformed", "undecodable"):
            for ex in d[f"{k}_examples"]:
                print(f"    {k}: {ex}")
    return 1 if summary.failures else 0


if __name__ == "__main__":
    sys.exit(main())
