"""Input a hostile or careless local user can send: the broker answers with an error naming what is
wrong, executes nothing malformed, and keeps serving everyone (issue 12, items 1 and 2)."""

import msgpack
import pytest

import ipcpool
from ipcpool import fdpass, protocol
from tests.support.raw import control, reply_then_eof

MIXED = {"op": "hello", "version": 1, "a": 1, b"b": 2}


def still_serving(broker) -> None:
    with ipcpool.connect(broker.socket_dir, arena_bytes=0) as c:   # exact pool accounting
        with c.allocate(4096) as buf:
            buf.view[:2] = b"ok"
            assert c.stats()["pools"]["default"]["used"] == 4096
    assert broker.proc.poll() is None


@pytest.mark.parametrize("hello", [MIXED, {b"op": "hello", "version": 1}, {"op": "hello", "version": 1, b"version": 1}])
def test_a_hello_mixing_str_and_bytes_keys_is_refused(broker, hello):
    with control(broker) as s:
        s.send(msgpack.packb(hello, use_bin_type=True))
        msg = reply_then_eof(s)
    assert msg["ok"] is False and msg["code"] == ipcpool.ProtocolError.code
    assert "field names must be strings" in msg["error"]
    still_serving(broker)


def test_mixed_keys_inside_a_session_on_both_sockets(broker, raw_session):
    s, d = raw_session
    s.send(msgpack.packb({"op": "pool_fd", "pool": "default", "id": 3, b"b": 2}, use_bin_type=True))
    err, fds = fdpass.recv(s)
    assert (err["ok"], err["id"], err["code"], fds) == (False, 3, ipcpool.ProtocolError.code, [])
    d.send(msgpack.packb({"op": "stats", "id": 4, "a": 1, b"b": 2}, use_bin_type=True))
    reply = protocol.unpack(d.recv(), protocol.MAX_REPLY)
    assert reply["ok"] is False and reply["id"] == 4 and "field names must be strings" in reply["error"]
    d.send(protocol.pack({"op": "ping", "id": 5}))
    assert protocol.unpack(d.recv()) == {"id": 5, "ok": True}
    still_serving(broker)


@pytest.mark.parametrize("rid", [-1, "7", None, 1.5, True, False, 1 << 63, (1 << 64) - 1, b"\x07", [7]])
def test_a_bad_id_is_refused_and_nothing_is_executed(broker, raw_session, rid):
    _, d = raw_session
    d.send(protocol.pack({"op": "allocate", "id": rid, "nbytes": 4096, "pool": "default"}))
    reply = protocol.unpack(d.recv(), protocol.MAX_REPLY)
    assert reply["ok"] is False and reply["id"] == 0 and reply["code"] == ipcpool.ProtocolError.code
    assert "field 'id'" in reply["error"]
    with ipcpool.connect(broker.socket_dir) as c:
        assert c.stats()["pools"]["default"]["used"] == 0   # the allocation never happened


def test_a_request_without_an_id_is_refused(broker, raw_session):
    _, d = raw_session
    d.send(protocol.pack({"op": "allocate", "nbytes": 4096, "pool": "default"}))
    reply = protocol.unpack(d.recv(), protocol.MAX_REPLY)
    assert (reply["ok"], reply["id"]) == (False, 0) and "missing field 'id'" in reply["error"]


@pytest.mark.parametrize(
    "msg, text",
    [
        ({"op": "allocate", "id": 9, "nbytes": 1.0, "pool": "default"}, "field 'nbytes' must be int, got float"),
        ({"op": "allocate", "id": 9, "nbytes": 1, "pool": 5}, "field 'pool' must be str, got int"),
        ({"op": "get", "id": 9, "name": "a", "timeout_ms": True}, "field 'timeout_ms' must be int, got bool"),
        ({"op": "watch", "id": 9, "prefix": "a", "existing": 1}, "field 'existing' must be bool, got int"),
        ({"op": "free", "id": 9, "alloc": 1, "done_event": "x"}, "field 'done_event' must be bytes, got str"),
        ({"op": "get_many", "id": 9, "names": "abc"}, "field 'names' must be list, got str"),
        ({"op": "create", "id": 9, "name": "a", "nbytes": 1, "pool": "default", "meta": []}, "field 'meta' must be dict"),
        ({"op": "trim", "id": 9, "pool": "default"}, "missing field 'keep'"),
        ({"op": "ping", "id": 9, "evil": 1}, "unexpected fields 'evil'"),
        ({"op": 5, "id": 9}, "unknown op 5"),
    ],
)
def test_wrong_fields_are_named(broker, raw_session, msg, text):
    _, d = raw_session
    d.send(protocol.pack(msg))
    reply = protocol.unpack(d.recv(), protocol.MAX_REPLY)
    assert reply["ok"] is False and reply["id"] == 9 and text in reply["error"]


@pytest.mark.parametrize("n", [300, protocol.MAX_STR])
def test_a_long_unknown_op_is_not_echoed_back(broker, raw_session, n):
    s, d = raw_session
    d.send(protocol.pack({"op": "Z" * n, "id": 9}))
    data = d.recv()
    reply = protocol.unpack(data, protocol.MAX_REPLY)   # decodable by a client
    assert reply["ok"] is False and "unknown op 'ZZZ" in reply["error"] and len(reply["error"]) < 200
    s.send(protocol.pack({"op": "Q" * n, "id": 3}))
    err, _ = fdpass.recv(s)
    assert err["ok"] is False and len(err["error"]) < 200


def test_every_error_reply_fits_what_a_client_decodes(broker, raw_session):
    _, d = raw_session
    d.send(protocol.pack({"op": "create", "id": 9, "name": "a", "nbytes": 1, "pool": "default",
                          "meta": {"dtype": "q" * 4000}}))
    reply = protocol.unpack(d.recv(), protocol.MAX_REPLY)
    assert reply["ok"] is False and "dtype" in reply["error"] and len(reply["error"]) <= protocol.MAX_ERROR


def test_hostile_frames_on_the_control_socket_are_answered_and_execute_nothing(broker, raw_session):
    """The hand-off's frames (``ipcpool.frames``) are answered on the message channel like any
    request: a frame that does not decode, names a range the session never carved, or seals what it
    is not writing gets an error for its id; the session and the broker go on."""
    from ipcpool import frames

    s, d = raw_session
    d.send(protocol.pack({"op": "ping", "id": 1}))   # the ROUTER knows the session from here
    assert protocol.unpack(d.recv(), protocol.MAX_REPLY)["ok"]
    sent = {
        2: (frames.create(2, b"default", b"x", b"", 999, 0, 4096, None, 0, bytes(64)), "arena"),
        3: (frames.seal(3, b"x", bytes(64)), "not an object this session is writing"),
        4: (frames.create(4, b"default", b"../x", b"", 1, 0, 4096, None, 0, bytes(64)), "invalid object name"),
        5: (frames.create(5, b"default", b"y", b"", 1, 0, 4096, None, 0, bytes(64))[:-1], "does not match its header"),
        6: (b"\xc1\x07" + bytes(10) + (6).to_bytes(8, "little"), "unknown frame kind 7"),
    }
    for data, _ in sent.values():
        s.send(data)
    d.send(protocol.pack({"op": "stats", "id": 7}))
    replies = {}
    while len(replies) < 6 and d.poll(5000):
        r = protocol.unpack(d.recv(), protocol.MAX_REPLY)
        replies[r["id"]] = r
    assert sorted(replies) == [2, 3, 4, 5, 6, 7], replies
    for rid, (_, says) in sent.items():
        assert replies[rid]["ok"] is False and says in replies[rid]["error"], replies[rid]
    assert replies[7]["ok"] and replies[7]["objects"] == 0   # nothing was created
    still_serving(broker)
