"""Malformed, truncated and oversized input on both sockets: an error reply or a disconnect, and
the broker keeps serving everyone else."""

import array
import os
import socket
import time

import msgpack
import pytest
import zmq

import ipcpool
from ipcpool import fdpass, protocol
from tests.support.fds import fd_count
from tests.support.raw import control, reply_then_eof


@pytest.mark.parametrize(
    "payload, code, text",
    [
        (b"\xc1\xc1\xc1", ipcpool.ProtocolError.code, "undecodable"),
        (protocol.pack({"op": "hello", "version": 1})[:-1], ipcpool.ProtocolError.code, "undecodable"),
        (msgpack.packb([1, 2]), ipcpool.ProtocolError.code, "must be a map"),
        (b"x" * (protocol.MAX_MESSAGE + 100), ipcpool.ProtocolError.code, "exceeds the limit"),
        (protocol.pack({"op": "hello", "version": 99}), ipcpool.ProtocolError.code, "version 99"),
        (protocol.pack({"op": "hello", "version": 1}), ipcpool.ProtocolError.code, "version 1"),   # before growables moved
        (protocol.pack({"op": "pool_fd", "pool": "default"}), ipcpool.ProtocolError.code, "expected hello"),
        (protocol.pack({"op": "hello"}), ipcpool.ProtocolError.code, "missing field 'version'"),
    ],
)
def test_bad_hello_gets_an_error_then_disconnect(broker, payload, code, text):
    with control(broker) as s:
        s.send(payload)
        msg = reply_then_eof(s)
    assert msg["ok"] is False and msg["code"] == code and text in msg["error"]
    with ipcpool.connect(broker.socket_dir) as c:   # still serving
        assert c.stats()["sessions"] == 1


def test_fds_pushed_at_the_broker_are_refused_and_closed(broker):
    with ipcpool.connect(broker.socket_dir) as c:   # warm up the broker's own FDs
        c.stats()
    before = fd_count(broker.pid)
    r, w = os.pipe()
    try:
        with control(broker) as s:
            s.sendmsg([protocol.pack({"op": "hello", "version": 1})],
                      [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r, w]))])
            msg = reply_then_eof(s)
        assert "too many file descriptors" in msg["error"]
    finally:
        os.close(r)
        os.close(w)
    assert fd_count(broker.pid) <= before   # the two pushed FDs never stay in the broker


def test_bad_control_message_in_an_open_session(broker):
    with control(broker) as s:
        fdpass.send(s, {"op": "hello", "version": protocol.PROTOCOL_VERSION})
        hello, _ = fdpass.recv(s)
        assert hello["ok"] and len(hello["token"]) == 16
        fdpass.send(s, {"op": "pool_fd", "pool": "nope", "id": 4})
        err, fds = fdpass.recv(s)
        assert (err["id"], err["ok"], err["code"], fds) == (4, False, ipcpool.UnknownPool.code, [])
        assert "no pool named 'nope'" in err["error"]
        fdpass.send(s, {"op": "pool_fd", "pool": "default", "id": 5})
        ok, fds = fdpass.recv(s)
        # the pool, its seal board, its name directory and (the first time) the session's lease page
        assert ok["ok"] and ok["info"]["name"] == "default" and len(fds) == 4 and ok["lease_page"]
        for fd in fds:
            os.close(fd)
        s.send(b"\x92garbage")
        msg = reply_then_eof(s)
        assert msg["code"] == ipcpool.ProtocolError.code
    with ipcpool.connect(broker.socket_dir) as c:
        assert c.stats()["pools"]["default"]["used"] == 0


@pytest.mark.parametrize(
    "frames, text",
    [
        ([b"\xc1"], "undecodable"),
        ([protocol.pack({"op": "allocate", "id": 9, "nbytes": 5, "pool": "default"})[:-3]], "undecodable"),
        ([msgpack.packb("just a string")], "must be a map"),
        ([protocol.pack({"op": "allocate", "id": 9, "nbytes": "5", "pool": "default"})], "must be int"),
        ([protocol.pack({"op": "launch_missiles", "id": 9})], "unknown op"),
        ([b"a", b"b"], "expected one message frame"),
        ([protocol.pack({"op": "free", "id": 9, "alloc": 12345})], "not held by this session"),
        ([protocol.pack({"op": "allocate", "id": 9, "nbytes": 1, "pool": "nope"})], "no pool named"),
        ([protocol.pack({"op": "allocate", "id": 9, "nbytes": 1 << 50, "pool": "default"})], "no free block"),
    ],
)
def test_bad_messages_get_error_replies(broker, raw_session, frames, text):
    _, d = raw_session
    d.send_multipart(frames)
    reply = protocol.unpack(d.recv())
    assert reply["ok"] is False and text in reply["error"]
    d.send(protocol.pack({"op": "ping", "id": 10}))       # the session still works
    assert protocol.unpack(d.recv()) == {"id": 10, "ok": True}


def test_oversized_message_disconnects_only_that_peer(broker, raw_session):
    _, d = raw_session
    with ipcpool.connect(broker.socket_dir) as good:
        d.send(b"\x00" * (protocol.MAX_MESSAGE + 1))
        with pytest.raises(zmq.Again):
            d.recv()                                        # dropped, no reply
        assert good.stats()["sessions"] == 2                # everyone else is served


def test_unknown_token_is_refused(broker):
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.IDENTITY, b"forged-token-123")
    d.setsockopt(zmq.RCVTIMEO, 5000)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(f"ipc://{broker.socket_dir / 'broker.zmq'}")
    try:
        d.send(protocol.pack({"op": "allocate", "id": 1, "nbytes": 10, "pool": "default"}))
        reply = protocol.unpack(d.recv())
    finally:
        d.close()
        ctx.term()
    assert reply["code"] == ipcpool.PeerRefused.code and "unknown or expired session token" in reply["error"]
    with ipcpool.connect(broker.socket_dir) as c:
        assert c.stats()["pools"]["default"]["used"] == 0


def test_a_storm_of_random_and_mutated_messages(broker, raw_session):
    """Thousands of random and bit-flipped requests on both sockets: every one is answered or
    dropped, the broker keeps serving, and it holds no more FDs than before."""
    import random

    rng = random.Random(20261122)
    _, d = raw_session
    valid = [
        protocol.pack({"op": "allocate", "id": 1, "nbytes": 4096, "pool": "default"}),
        protocol.pack({"op": "create", "id": 2, "name": "storm/x", "nbytes": 64, "pool": "default",
                       "meta": {"dtype": "uint8", "shape": [64], "user": {"k": "v"}}}),
        protocol.pack({"op": "get_many", "id": 3, "names": ["a", "b"]}),
        protocol.pack({"op": "watch", "id": 4, "prefix": "storm/", "existing": True}),
    ]
    with ipcpool.connect(broker.socket_dir) as c:
        c.stats()
        fds_before = fd_count(broker.pid)
    sent = 0
    for i in range(2000):
        base = bytearray(rng.choice(valid))
        kind = i % 3
        if kind == 0:      # flip bytes
            for _ in range(rng.randint(1, 4)):
                base[rng.randrange(len(base))] = rng.randrange(256)
            frame = bytes(base)
        elif kind == 1:    # truncate
            frame = bytes(base[: rng.randrange(len(base))])
        else:              # noise
            frame = rng.randbytes(rng.randint(0, 200))
        d.send(frame)
        sent += 1
    answered = 0
    while True:
        try:
            protocol.unpack(d.recv(), protocol.MAX_REPLY)
            answered += 1
        except zmq.Again:
            break
    assert answered > sent // 2          # most get an answer (mutated frees and such may not)
    for _ in range(200):                  # the control socket too: fresh connections, garbage hellos
        with control(broker) as s:
            s.send(rng.randbytes(rng.randint(1, 300)))
            try:
                while fdpass.recv(s) is not None:
                    pass
            except (OSError, ipcpool.ProtocolError):
                pass
    with ipcpool.connect(broker.socket_dir) as c:
        with c.allocate(1 << 20) as buf:
            buf.view[:4] = b"fine"
        assert c.stats()["sessions"] == 2   # this one and the raw session
    deadline = time.monotonic() + 5
    while fd_count(broker.pid) > fds_before + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert fd_count(broker.pid) <= fds_before + 2
