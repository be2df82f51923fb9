"""The broker checks a usual create (a frame on an arena whose first create it took in Python) in
one C call up to its directory entry (``ObjectTable.create_usual``). Each create it must refuse
is refused there as the Python refuses it, with the same error, and leaves nothing behind: no
entry a reader could find, no range taken in the arena's mirror, no name, no count."""

import pytest

import ipcpool
from ipcpool import frames
from ipcpool.shm import directory as layout, sealboard

KiB = 1 << 10
CREDIT = bytes(range(1, 65))


@pytest.fixture
def writer(start_broker):
    """A session whose arena has a ticket (its first create taken in Python), its quota 4
    objects, beside another session with an arena of its own."""
    b = start_broker(config_text="[quotas.default]\nobjects = 4\n")
    with ipcpool.connect(b.socket_dir) as w, ipcpool.connect(b.socket_dir) as other:
        first = w.create("first", 4 * KiB)
        first.seal()
        other_buf = other.create("other", 4 * KiB)
        other_buf.seal()
        w.flush()
        other.flush()
        yield w, first.carving.arena, other_buf.carving.arena


def _send(w, arena, name=b"c/1", offset=None, nbytes=4 * KiB, slot=7, seq=None, credit=b"", aid=None):
    """A create frame as the client's own, every field its own unless given."""
    offset = arena.carve(nbytes) if offset is None else offset
    seq = arena._seq + 50 if seq is None else seq
    w._channel.send_frame(frames.create, b"default", name, b"", arena.aid if aid is None else aid, offset, nbytes,
                          slot, seq, credit)
    w.list()   # (answered after the create: its refusal is in)
    return offset


def _refused(w, error, says):
    with pytest.raises(error, match=says):
        w.flush()


def _nothing_left(w, name: str, arena, offset: int) -> None:
    """No object, no entry, and the range free in the mirror: a good create takes it."""
    assert [o["name"] for o in w.list("c/")] == []
    view = w._pools.directories["default"][0]
    assert view.lookup(name) is None
    _send(w, arena, name=b"c/ok", offset=offset, slot=9)
    w.flush()
    assert [o["name"] for o in w.list("c/")] == ["c/ok"]
    entry = view.lookup("c/ok")
    assert entry is not None and entry.offset == offset and entry.state == layout.WRITING


def test_a_usual_create_is_entered_and_read_as_a_python_one(writer):
    w, arena, _ = writer
    assert w.stats()["handoff"]["checked_in_c"] == 0   # (each session's first create: in Python)
    seq = arena._seq + 9
    offset = _send(w, arena, name=b"c/1", slot=3, seq=seq)
    w.flush()
    entry = w._pools.directories["default"][0].lookup("c/1")
    assert (entry.alloc, entry.offset, entry.size, entry.word, entry.seq, entry.in_arena) == (
        arena.aid, offset, 4 * KiB, arena.words + 3, seq, True)
    assert entry.state == layout.WRITING and entry.event == b"" and entry.dtype is None
    assert w.stats()["handoff"]["checked_in_c"] == 1


@pytest.mark.parametrize("case, error, says", [
    ("arena of another session", ipcpool.InvalidRequest, "is not one of this session's"),
    ("word past the block", ipcpool.InvalidRequest, "has no seal-board word"),
    ("number past the last", ipcpool.InvalidRequest, "is outside"),
    ("no number", ipcpool.InvalidRequest, "a seq of at least 1"),
    ("a credit where the pool has no events", ipcpool.InvalidRequest, "names no seal_credit"),
    ("a name in use", ipcpool.ObjectExists, "already exists"),
    ("an invalid name", ipcpool.InvalidRequest, "invalid object name"),
    ("a range taken", ipcpool.InvalidRequest, "is not free"),
    ("a range past the arena", ipcpool.InvalidRequest, "is not free"),
    ("a misaligned offset", ipcpool.InvalidRequest, "is not aligned"),
])
def test_each_create_the_python_refuses_is_refused_alike_and_leaves_nothing(writer, case, error, says):
    w, arena, other = writer
    offset = arena.carve(4 * KiB)
    name = b"c/bad"
    kw = {
        "arena of another session": {"aid": other.aid},
        "word past the block": {"slot": sealboard.BLOCK},
        "number past the last": {"seq": sealboard.FIRST_MAX},
        "no number": {"seq": 0},
        "a credit where the pool has no events": {"credit": CREDIT},
        "a name in use": {"name": b"first"},
        "an invalid name": {"name": b"c/../x"},
        "a range taken": {"offset": offset},
        "a range past the arena": {"offset": arena.memory.size},
        "a misaligned offset": {"offset": offset + 8},
    }[case]
    if case == "a range taken":   # (by an object of its own, live)
        _send(w, arena, name=b"c/taken", offset=offset, slot=8)
        w.flush()
    _send(w, arena, name=kw.pop("name", name), offset=kw.pop("offset", offset), **kw)
    in_c = w.stats()["handoff"]["checked_in_c"]
    _refused(w, error, says)
    assert w._pools.directories["default"][0].lookup(name.decode()) is None
    assert w.stats()["handoff"]["checked_in_c"] == in_c   # (refused in Python, after C left it)
    if case not in ("a range taken", "a range past the arena", "a misaligned offset"):
        _nothing_left(w, name.decode(), arena, offset)


def test_the_objects_quota_is_kept_by_the_usual_create(writer):
    w, arena, _ = writer
    for k in (2, 3):   # the uid's third and fourth, its quota ("first" and "other" before)
        _send(w, arena, name=f"c/{k}".encode(), slot=k)
    w.flush()
    offset = _send(w, arena, name=b"c/4", slot=4)
    _refused(w, ipcpool.QuotaExceeded, "named objects, its quota")
    assert w._pools.directories["default"][0].lookup("c/4") is None
    w.delete("c/2")
    _send(w, arena, name=b"c/4", offset=offset, slot=4)   # its range was never taken
    w.flush()
    assert [o["name"] for o in w.list("c/")] == ["c/3", "c/4"]
