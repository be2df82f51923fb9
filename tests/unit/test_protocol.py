import msgpack
import pytest

from ipcpool import protocol
from ipcpool.errors import InvalidRequest, ProtocolError


def test_roundtrip_and_validation():
    msg = protocol.unpack(protocol.pack({"op": "allocate", "id": 3, "nbytes": 10, "pool": "default"}))
    assert protocol.validate(msg, protocol.REQUESTS) == ("allocate", {"nbytes": 10, "pool": "default"})
    assert protocol.request_id(msg) == 3


@pytest.mark.parametrize(
    "msg, match",
    [
        ({"op": "nope"}, "unknown op"),
        ({"nbytes": 1}, "unknown op"),
        ({"op": "allocate", "pool": "default"}, "missing field 'nbytes'"),
        ({"op": "allocate", "nbytes": "1", "pool": "default"}, "must be int"),
        ({"op": "allocate", "nbytes": True, "pool": "default"}, "must be int"),
        ({"op": "allocate", "nbytes": -1, "pool": "default"}, ">= 0"),
        ({"op": "allocate", "nbytes": 1 << 64, "pool": "default"}, "out of range"),
        ({"op": "allocate", "nbytes": 1, "pool": "x" * 300}, "longer than"),
        ({"op": "allocate", "nbytes": 1, "pool": "d", "evil": 1}, "unexpected fields"),
        ({"op": "free", "alloc": 1, "done_event": b"x" * 65}, "longer than 64"),
    ],
)
def test_bad_requests_are_protocol_errors(msg, match):
    with pytest.raises(ProtocolError, match=match):
        protocol.validate(msg, protocol.REQUESTS)


def test_a_get_wakes_for_an_entry_or_a_seal_only():
    for wake in ("entry", "seal"):
        assert protocol.validate({"op": "get", "name": "a", "wake": wake}, protocol.REQUESTS)[1]["wake"] == wake
    with pytest.raises(InvalidRequest, match="wake: 'entry' or 'seal', got 'lease'"):
        protocol.validate({"op": "get", "name": "a", "wake": "lease"}, protocol.REQUESTS)


@pytest.mark.parametrize("op, fields", [("free", {"alloc": 1}), ("seal", {"name": "a"}),
                                        ("create", {"name": "a", "nbytes": 1, "pool": "p"})])
def test_an_event_handle_is_64_bytes_or_none(op, fields):
    key = "seal_credit" if op == "create" else "done_event"
    for ok in (b"", b"e" * 64):
        protocol.validate({"op": op, **fields, key: ok}, protocol.REQUESTS)
    with pytest.raises(InvalidRequest, match="an IPC event handle is 64 bytes, got 10"):
        protocol.validate({"op": op, **fields, key: b"e" * 10}, protocol.REQUESTS)


@pytest.mark.parametrize(
    "data, match",
    [
        (b"\xc1", "undecodable"),                                  # never-used msgpack byte
        (protocol.pack({"op": "stats"})[:-2], "undecodable"),       # truncated
        (msgpack.packb([1, 2, 3]), "must be a map"),
        (b"\x00" * (protocol.MAX_MESSAGE + 1), "exceeds the limit"),
        (msgpack.packb({"op": "x" * (protocol.MAX_STR + 1)}), "undecodable"),
        (msgpack.packb({1: 2}), "undecodable"),                     # non-str keys
        (msgpack.packb({"a": msgpack.ExtType(1, b"x")}), "undecodable"),
    ],
)
def test_bad_bytes_are_protocol_errors(data, match):
    with pytest.raises(ProtocolError, match=match):
        protocol.unpack(data)


def test_error_reply_carries_code():
    from ipcpool.errors import OutOfMemory, error_from_wire

    reply = protocol.error_reply(5, OutOfMemory("full"))
    err = error_from_wire(reply["code"], reply["error"])
    assert type(err) is OutOfMemory and str(err) == "full"


def test_every_request_op_has_a_handler():
    from ipcpool.broker.handlers import Handlers

    missing = [op for op in protocol.REQUESTS if not callable(getattr(Handlers, f"op_{op}", None))]
    assert missing == []
