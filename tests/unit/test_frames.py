"""The hand-off's binary frames (``ipcpool.frames``): what a client builds, the broker reads back;
what a client could send instead is refused with an error naming what is wrong."""

import itertools
import re

import pytest

from ipcpool import frames, protocol
from ipcpool.errors import InvalidRequest, ProtocolError

CREDIT = bytes(range(64))


def _create(**over):
    args = dict(rid=7, pool=b"default", name=b"h/1", meta=b"", arena=3, offset=4096, nbytes=1 << 20,
                slot=5, seq=9, credit=CREDIT)
    args.update(over)
    return frames.create(**args)


def test_a_create_reads_back_as_the_message_channels_create():
    op, f = frames.parse(_create(meta=protocol.pack({"dtype": "float16", "shape": [4, 4]})))
    assert op == "create" and frames.request_id(_create()) == 7
    assert f == {"name": "h/1", "nbytes": 1 << 20, "pool": "default", "arena": 3, "offset": 4096,
                 "slot": 5, "seq": 9, "seal_credit": CREDIT, "meta": {"dtype": "float16", "shape": [4, 4]}}


def test_a_create_without_a_board_slot_or_credit_carries_neither():
    op, f = frames.parse(_create(slot=None, seq=0, credit=bytes(64)))
    assert "slot" not in f and "seq" not in f and "seal_credit" not in f


def test_a_seal_reads_back_with_its_done_event_or_without():
    assert frames.parse(frames.seal(8, b"h/1", CREDIT)) == ("seal", {"name": "h/1", "done_event": CREDIT})
    assert frames.parse(frames.seal(8, b"h/1", bytes(64))) == ("seal", {"name": "h/1"})
    assert frames.request_id(frames.seal(8, b"h/1", CREDIT)) == 8


def test_every_byte_string_starting_with_the_magic_is_a_frame_and_nothing_else_is():
    assert frames.is_frame(_create()) and frames.is_frame(b"\xc1")
    assert not frames.is_frame(protocol.pack({"op": "ping", "id": 1})) and not frames.is_frame(b"")


def test_the_brokers_read_of_a_create_gives_its_id_and_leaves_other_kinds_to_parse():
    c = frames.read_create(_create())
    assert c.rid == 7 and c.fields() == frames.parse(_create())[1]
    assert frames.read_create(frames.seal(8, b"h/1", CREDIT)) is None
    assert frames.read_create(b"\xc1\x09" + bytes(80)) is None


BAD = [
    (b"\xc1", ProtocolError, "shorter than its kind"),
    (b"\xc1\x09", ProtocolError, "unknown frame kind 9"),
    (_create()[:40], ProtocolError, "shorter than its header"),
    (_create() + b"x", ProtocolError, "does not match its header"),
    (frames.seal(1, b"h/1", CREDIT)[:-1], ProtocolError, "does not match its header"),
    (_create(name=b"../etc"), InvalidRequest, "invalid object name"),
    (_create(name=b"\xff\xfe"), ProtocolError, "not UTF-8"),
    (_create(pool=b""), InvalidRequest, "field 'pool' must be 1 to 255 bytes"),
    (_create(meta=b"\x93\x01\x02\x03"), ProtocolError, "message must be a map"),
    (_create(meta=protocol.pack({"colour": 1})), InvalidRequest, "unknown metadata keys"),
    (_create(meta=protocol.pack({"user": "x" * 5000})), ProtocolError, "metadata is at most 4096 bytes"),
    (_create(rid=1 << 63), ProtocolError, "id must be in"),
    (_create(rid=1 << 63)[:40], ProtocolError, "id must be in"),
]


@pytest.mark.parametrize("data, error, says", BAD)
def test_a_bad_frame_is_refused_saying_why(data, error, says):
    with pytest.raises(error, match=says):
        frames.parse(data)


@pytest.mark.parametrize("data, error, says", [b for b in BAD if b[0][1:2] == bytes([frames.CREATE])])
def test_the_brokers_read_of_a_create_refuses_what_parse_does(data, error, says):
    """The broker reads a create frame with ``read_create`` alone (no ``kind`` first)."""
    with pytest.raises(error, match=says):
        frames.read_create(data)


# -- the usual create read in C (``shm/_native.c``) ------------------------------------------------
USUAL = [_create(), _create(slot=None, seq=0, credit=bytes(64)), _create(credit=bytes(64)),
         _create(name=b"a"), _create(name=b"layer.0/w:q-k_v/"), _create(pool=b"p" * 255, name=b"n" * 255),
         _create(rid=(1 << 63) - 1, arena=(1 << 64) - 1, offset=0, nbytes=1, slot=0, seq=(1 << 64) - 1)]
NOT_USUAL = [_create(meta=protocol.pack({"dtype": "float16", "shape": [4]})), _create(pool="pöol".encode()),
             _create(name="naïve".encode()), _create(name=b"a/../b"), _create(rid=1 << 63), _create()[:-1],
             _create() + b"x", frames.seal(8, b"h/1", CREDIT), _create()[:40]]


def _python_read(monkeypatch, data):
    monkeypatch.setattr(frames, "_native_read_create", None)
    try:
        return frames.read_create(data)
    finally:
        monkeypatch.undo()


def test_the_c_read_of_a_usual_create_gives_what_python_reads(monkeypatch):
    native = pytest.importorskip("ipcpool.shm._native", reason="not built here (no C compiler when installed)")
    assert native.CREATE_SIZE == frames._CREATE_SIZE and native.ID_AT == frames._ID_AT
    for data in USUAL:
        got = native.read_create(data)
        assert got is not None, data
        c = frames.read_create(data)
        assert type(c) is frames.Create and c == _python_read(monkeypatch, data)
        assert [type(v) for v in c] == [type(v) for v in _python_read(monkeypatch, data)]
    assert native.read_create(memoryview(USUAL[0])) == native.read_create(USUAL[0])


def test_every_other_frame_is_left_to_python_which_reads_or_refuses_it(monkeypatch):
    native = pytest.importorskip("ipcpool.shm._native", reason="not built here (no C compiler when installed)")
    for data in NOT_USUAL:
        assert native.read_create(data) is None, data
        try:
            want = _python_read(monkeypatch, data)
        except (InvalidRequest, ProtocolError) as exc:
            with pytest.raises(type(exc), match=re.escape(str(exc))):
                frames.read_create(data)
        else:
            assert frames.read_create(data) == want
    with pytest.raises(TypeError):
        native.read_create("not bytes")


def test_the_c_read_takes_exactly_the_names_the_protocol_takes():
    """Every name of up to five characters of letters, digits and the characters a name may hold
    or that make one invalid: the C check and ``protocol.NAME_RE`` agree on each."""
    native = pytest.importorskip("ipcpool.shm._native", reason="not built here (no C compiler when installed)")
    disagree = []
    for n in range(6):
        for chars in itertools.product("a9./_:-", repeat=n):
            name = "".join(chars)
            c = native.read_create(_create(name=name.encode())) is not None
            if c != bool(protocol.NAME_RE.fullmatch(name)):
                disagree.append(name)
    assert disagree == []
