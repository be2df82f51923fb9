"""The broker's C check of a usual create (``_native.usual_create``) against the Python it stands
in for, on real mirrors and real directories: a run of creates, some overlapping, misaligned or out
of bounds, taken or left alike by ``TakenRanges.reserve``; the entries written byte for byte as
``Directory.publish`` writes them; every other check declining with nothing changed."""

import random
import types

import pytest

from ipcpool import frames
from ipcpool.broker.arenas import Ticket
from ipcpool.errors import InvalidRequest
from ipcpool.ranges import TakenRanges
from ipcpool.shm import directory as layout, sealboard

native = pytest.importorskip("ipcpool.shm._native", reason="not built here (no C compiler when installed)")

ARENA, WORDS, FIRST_SEQ, CAPACITY, ALIGN, UID = 5, 512, 40, 1 << 20, 256, 1000
CREDIT = bytes(range(1, 65))


class Twin:
    """One arena's mirror and its pool's directory; the C side gets them through a ticket."""

    def __init__(self, session, promises=None, limit=0):
        self.ranges = TakenRanges(CAPACITY, ALIGN)
        self.directory = layout.Directory("p", 64)
        self.arena = types.SimpleNamespace(closed=False)
        starts, sizes = self.ranges.shared()
        self.ticket = Ticket(self.arena, session, "default", WORDS, FIRST_SEQ, starts, sizes, self.ranges.capacity,
                             ALIGN, self.directory.mapping, self.directory.capacity, self.directory.probes,
                             promises, limit, UID)

    def close(self):
        self.directory.close()


def _frame(name=b"h/1", offset=0, nbytes=4096, slot=3, seq=FIRST_SEQ, credit=b"", arena=ARENA, pool=b"default"):
    return frames.create(9, pool, name, b"", arena, offset, nbytes, slot, seq, credit)


@pytest.fixture
def twins():
    session = object()
    made = [Twin(session), Twin(session)]
    yield session, made
    for t in made:
        t.close()


def _c(twin, session, data, objects=None, counts=None, gen=1):
    return native.usual_create(data, session, {ARENA: twin.ticket}, objects or {}, counts or {}, gen)


def test_a_run_of_creates_takes_and_writes_what_the_python_does(twins):
    """C on one twin, the Python's reserve and publish on the other: the same answers, the same
    mirror, the same directory bytes, create after create."""
    session, (c_side, py_side) = twins
    rng = random.Random(7)
    taken = 0
    for gen in range(1, 400):
        offset = rng.choice([rng.randrange(0, CAPACITY, ALIGN), rng.randrange(0, CAPACITY), CAPACITY - ALIGN,
                             CAPACITY])
        nbytes = rng.choice([1, ALIGN, 4096, 5000, 1 << 16, CAPACITY])
        name, slot, seq = f"h/{gen}", gen % sealboard.BLOCK, FIRST_SEQ + gen
        got = _c(c_side, session, _frame(name.encode(), offset, nbytes, slot, seq), gen=gen)
        try:
            size = py_side.ranges.reserve(offset, nbytes)
        except InvalidRequest:
            assert got is None, (offset, nbytes)
            continue
        index = py_side.directory.publish(name, gen, layout.WRITING, ARENA, offset, nbytes, WORDS + slot, seq, b"",
                                          None, None, False, True, False)
        assert got is not None, (offset, nbytes)
        fields, c_size, c_index = got
        assert fields == tuple(frames.read_create(_frame(name.encode(), offset, nbytes, slot, seq)))
        assert (c_size, c_index) == (size, index)
        c_side.ranges.took(c_size)
        if c_index is not None:
            c_side.directory.written(c_index, name.encode())
        taken += 1
        if rng.random() < 0.3:   # some go again: their ranges and entries free for the next
            at = rng.choice(py_side.ranges.offsets())
            for twin in (c_side, py_side):
                twin.ranges.free(at)
    assert taken > 20
    assert c_side.ranges.shared() == py_side.ranges.shared() and c_side.ranges.used == py_side.ranges.used
    assert bytes(c_side.directory.mapping) == bytes(py_side.directory.mapping)


def test_a_promised_credit_is_written_as_a_kept_event(twins):
    session, (c_side, py_side) = twins
    c_side.ticket = c_side.ticket._replace(promises={CREDIT: None})
    got = _c(c_side, session, _frame(credit=CREDIT))
    index = py_side.directory.publish("h/1", 1, layout.WRITING, ARENA, 0, 4096, WORDS + 3, FIRST_SEQ, CREDIT,
                                      None, None, False, True, True)
    assert got[0][-1] == CREDIT and got[2] == index
    assert bytes(c_side.directory.mapping) == bytes(py_side.directory.mapping)


@pytest.mark.parametrize("case", [
    "another session", "a closed arena", "no ticket", "another pool", "no slot", "a word past the block",
    "a number below the arena's", "a number past the last", "a credit with no events", "no credit with events",
    "a credit not the session's", "a name in use", "the quota reached", "metadata", "an invalid name", "a seal frame",
])
def test_every_create_the_python_would_refuse_or_read_itself_is_declined_with_nothing_changed(twins, case):
    session, (twin, _) = twins
    data, objects, counts, tickets, who = _frame(), {}, {}, {ARENA: twin.ticket}, session
    if case == "another session":
        who = object()
    elif case == "a closed arena":
        twin.arena.closed = True
    elif case == "no ticket":
        tickets = {}
    elif case == "another pool":
        data = _frame(pool=b"other")
    elif case == "no slot":
        data = _frame(slot=None, seq=0)
    elif case == "a word past the block":
        data = _frame(slot=sealboard.BLOCK)
    elif case == "a number below the arena's":
        data = _frame(seq=FIRST_SEQ - 1)
    elif case == "a number past the last":
        data = _frame(seq=sealboard.FIRST_MAX)
    elif case == "a credit with no events":
        data = _frame(credit=CREDIT)
    elif case == "no credit with events":
        tickets = {ARENA: twin.ticket._replace(promises={CREDIT: None})}
    elif case == "a credit not the session's":
        tickets = {ARENA: twin.ticket._replace(promises={bytes(64 * [9]): None})}
        data = _frame(credit=CREDIT)
    elif case == "a name in use":
        objects = {"h/1": object()}
    elif case == "the quota reached":
        tickets = {ARENA: twin.ticket._replace(limit=3)}
        counts = {UID: 3}
    elif case == "metadata":
        data = frames.create(9, b"default", b"h/1", b"\x80", ARENA, 0, 4096, 3, FIRST_SEQ, b"")
    elif case == "an invalid name":
        data = _frame(name=b"h/../x")
    elif case == "a seal frame":
        data = frames.seal(9, b"h/1", b"")
    before = bytes(twin.directory.mapping)
    assert native.usual_create(data, who, tickets, objects, counts, 1) is None
    assert twin.ranges.shared() == ([], {}) and bytes(twin.directory.mapping) == before
    twin.arena.closed = False   # ... and the usual create, with that one thing as it should be, is taken
    assert native.usual_create(_frame(), session, {ARENA: twin.ticket}, {}, {}, 1) is not None


def test_the_constants_are_the_layouts():
    assert native.BOARD_BLOCK == sealboard.BLOCK and native.FIRST_MAX == sealboard.FIRST_MAX
    assert list(Ticket._fields)[:3] == ["arena", "session", "pool"] and len(Ticket._fields) == 15
