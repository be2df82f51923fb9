"""The request ring's layout logic (``ipcpool.shm.requests``) on one mapping both sides share."""

from __future__ import annotations

import mmap
import struct
import time

import pytest

from ipcpool import frames
from ipcpool.errors import ProtocolError
from ipcpool.shm import requests


def _pair():
    m = mmap.mmap(-1, requests.AT + requests.LENGTH)
    return requests.RingWriter(m), requests.RingReader(m), m


def test_frames_come_out_in_order_and_whole_across_the_wrap():
    w, r, _ = _pair()
    sent = []
    for k in range(3 * requests.SLOTS + 5):   # several turns of the ring
        frame = bytes([k % 251]) * (1 + k % requests.MAX_FRAME)
        assert w.put(frame)
        sent.append(frame)
        if k % 4 == 3:
            assert r.take() == sent
            sent = []
    assert r.take() == sent and not r.waiting()


def test_a_full_ring_or_a_frame_too_large_is_refused_to_the_writer():
    w, r, _ = _pair()
    assert not w.put(bytes(requests.MAX_FRAME + 1))
    for _ in range(requests.SLOTS):
        assert w.put(b"x")
    assert not w.put(b"x")   # every slot waits for the broker
    assert len(r.take()) == requests.SLOTS
    assert w.put(b"y") and r.take() == [b"y"]


@pytest.mark.parametrize("head, length, says", [
    (requests.SLOTS + 1, 1, f"head {requests.SLOTS + 1} against 0 taken"),
    (2**64 - 1, 1, "against 0 taken"),
    (1, 0, "a frame of 0 bytes"),
    (1, requests.MAX_FRAME + 1, f"a frame of {requests.MAX_FRAME + 1} bytes"),
])
def test_a_ring_that_does_not_add_up_is_a_protocol_error(head, length, says):
    _, r, m = _pair()
    struct.pack_into("<I", m, requests.AT + 128, length)
    struct.pack_into("<Q", m, requests.AT, head)
    with pytest.raises(ProtocolError, match="request ring does not add up") as err:
        r.take()
    assert says in str(err.value)


# -- a frame built ahead, completed and put in C (``_native.ring_put``, ``requests.put_ready``) --

native = pytest.importorskip("ipcpool.shm._native", reason="ipcpool's C part is not built here")


class _Awake:
    """A directory's header as ``put_ready`` reads it: until when the broker polls."""

    def __init__(self, until_ns: int):
        self.mapping = bytearray(4096)
        struct.pack_into("<Q", self.mapping, native.AWAKE_AT, until_ns)


def _awake_for(seconds: float) -> _Awake:
    return _Awake(time.monotonic_ns() + int(seconds * 1e9))


def test_the_c_layout_is_the_python_one():
    from ipcpool.shm import directory, sealboard

    assert (native.RING_SLOT, native.RING_SLOTS_AT, native.RING_MARGIN_NS) == (
        requests.SLOT, requests._SLOTS_AT, requests.MARGIN_NS)
    assert native.AWAKE_AT == directory._AWAKE_AT and native.ID_AT == frames._ID_AT
    assert (native.BOARD_WORDS, native.SLEEPERS_AT) == (sealboard.WORDS, sealboard._SLEEPERS_AT)


def _put_ready(w, directory, *args):
    """A frame built ahead, put as a steady writer's create and seal go: one C call on its route's maps."""
    return requests.put_ready(*requests.Route.of(w, directory).maps, *args)


@pytest.mark.parametrize("ahead, name_at, build", [
    (frames.create(0, b"default", b"", b"", 3, 4096, 1 << 20, 7, 99, bytes(range(64))), frames.CREATE_NAME_LEN_AT,
     lambda rid, name: frames.create(rid, b"default", name.encode(), b"", 3, 4096, 1 << 20, 7, 99, bytes(range(64)))),
    (frames.seal(0, b"", bytes(64)), frames.SEAL_NAME_LEN_AT,
     lambda rid, name: frames.seal(rid, name.encode(), bytes(64))),
])
def test_a_frame_put_ahead_is_the_frame_built_whole(ahead, name_at, build):
    w, r, _ = _pair()
    names = [f"step/{k}" for k in range(2 * requests.SLOTS + 3)] + ["é/" + "x" * 200]
    for k, name in enumerate(names):   # across the ring's wrap, C and Python puts sharing its count
        rid = 1000 + k
        if k % 3:
            assert _put_ready(w, _awake_for(1), ahead, name_at, rid, name) == 1
        else:
            assert w.put(frames.completed(rid, ahead, name_at, name))
        assert r.take() == [build(rid, name)]
        assert frames.request_id(build(rid, name)) == rid


def test_a_frame_is_put_ahead_only_while_the_broker_polls_long_enough():
    w, r, _ = _pair()
    ahead = frames.seal(0, b"", bytes(64))
    assert _put_ready(w, _Awake(0), ahead, frames.SEAL_NAME_LEN_AT, 1, "a") == 0   # it sleeps: the socket
    assert _put_ready(w, _awake_for(requests.MARGIN_NS / 2e9), ahead, frames.SEAL_NAME_LEN_AT, 2, "b") == 0
    assert r.take() == []
    assert _put_ready(w, _awake_for(1), ahead, frames.SEAL_NAME_LEN_AT, 4, "d") == 1
    assert [frames.request_id(f) for f in r.take()][-1] == 4


def test_a_full_ring_or_a_frame_too_large_is_not_put_ahead():
    w, r, _ = _pair()
    ahead, at = frames.seal(0, b"", bytes(64)), frames.SEAL_NAME_LEN_AT
    assert _put_ready(w, _awake_for(1), ahead, at, 1, "n" * (requests.MAX_FRAME - len(ahead) + 1)) == 0
    assert _put_ready(w, _awake_for(1), ahead, at, 1, "n" * (requests.MAX_FRAME - len(ahead))) == 1
    for k in range(requests.SLOTS - 1):
        assert _put_ready(w, _awake_for(1), ahead, at, 2 + k, "x") == 1
    assert _put_ready(w, _awake_for(1), ahead, at, 99, "x") == 0   # every slot waits for the broker
    assert len(r.take()) == requests.SLOTS


@pytest.mark.parametrize("args, error", [
    ((b"short", frames.SEAL_NAME_LEN_AT, 1, "a"), None),         # not a frame: not put (0)
    ((frames.seal(0, b"", bytes(64)), 11, 1, "a"), None),        # a length that would overwrite the id
    ((frames.seal(0, b"", bytes(64)), 2, 1, b"a"), TypeError),   # a name is a str
])
def test_bad_calls_to_the_c_put_put_nothing(args, error):
    w, r, m = _pair()
    if error is None:
        assert _put_ready(w, _awake_for(1), *args) == 0
    else:
        with pytest.raises(error):
            _put_ready(w, _awake_for(1), *args)
    with pytest.raises(ValueError, match="shorter than its header"):
        native.ring_put(m, b"tiny", frames.seal(0, b"", bytes(64)), 2, 1, "a")
    with pytest.raises(ValueError, match="shorter than its request ring"):
        native.ring_put(bytearray(100), _awake_for(1).mapping, frames.seal(0, b"", bytes(64)), 2, 1, "a")
    assert r.take() == []


# -- a seal's record, board post and frame in one C call (``_native.seal_put``, ``requests.put_sealed``) --

def _board():
    from ipcpool.shm import sealboard

    return sealboard.Board.create("seal-put")


def _put_sealed(w, directory, board, event, word, seq, rid, name):
    ahead = frames.seal(0, b"", bytes(range(64)))
    return requests.put_sealed(event, 0, board.mapping, word, seq, *requests.Route.of(w, directory).maps, ahead,
                               frames.SEAL_NAME_LEN_AT, rid, name)


def test_a_seal_in_one_call_posts_its_word_then_puts_its_frame_whole():
    """Nothing to record (host memory: event 0): the word posted, then the seal frame put as
    ``frames.seal`` builds it; where the broker does not poll, posted all the same, not put (0)."""
    w, r, _ = _pair()
    board = _board()
    try:
        assert _put_sealed(w, _awake_for(1), board, 0, 5, 41, 77, "hand/off") == 1
        assert board.read(5) == 41
        assert r.take() == [frames.seal(77, b"hand/off", bytes(range(64)))]
        assert _put_sealed(w, _Awake(0), board, 0, 6, 42, 78, "asleep") == 0
        assert board.read(6) == 42 and r.take() == []
    finally:
        board.close()


def test_a_seal_in_one_call_wakes_a_reader_asleep_on_its_word():
    """A reader asleep on the word (``Board.sleep``, a real futex) wakes at the post, not at its
    timeout."""
    import threading

    w, _, _ = _pair()
    board = _board()
    woke = []
    try:
        sleeper = threading.Thread(target=lambda: woke.append((board.sleep(9, 0, 5.0), time.monotonic())))
        sleeper.start()
        while not board.sleeping:   # (its deadline said: it sleeps, or is about to)
            time.sleep(0.001)
        time.sleep(0.05)
        posted = time.monotonic()
        assert _put_sealed(w, _awake_for(1), board, 0, 9, 3, 1, "wake") == 1
        sleeper.join(5)
        assert woke and woke[0][0] and woke[0][1] - posted < 1.0, woke
    finally:
        board.close()


def test_a_seal_in_one_call_does_nothing_without_a_driver_or_off_its_board():
    """An event to record with no CUDA driver loaded (this host): -1, nothing posted, nothing put
    (the caller seals the general way); a word off the board: IndexError, nothing put."""
    from tests.unit.test_sealboard_sleep import _driver_loaded

    w, r, _ = _pair()
    board = _board()
    try:
        if not _driver_loaded():
            assert _put_sealed(w, _awake_for(1), board, 1, 5, 41, 77, "no/driver") == -1
            assert board.read(5) == 0 and r.take() == []
        with pytest.raises(IndexError, match="no such seal board word"):
            _put_sealed(w, _awake_for(1), board, 0, 1 << 16, 41, 77, "off/board")
        assert r.take() == []
    finally:
        board.close()


# -- a map pinned for the C calls (``sealing.pinned``: ``_native.Pinned``) --

def test_a_pinned_map_serves_the_c_calls_until_released_and_holds_the_map_open():
    """The C put through a pinned page writes what it writes through the map itself; the map
    cannot close while pinned; once released, a call raises instead of reading the closed map."""
    from ipcpool.shm import sealing

    w, r, m = _pair()
    held = sealing.pinned(m, writable=True)
    ahead = frames.seal(0, b"", bytes(64))
    awake = _awake_for(1)
    assert native.ring_put(held, awake.mapping, ahead, frames.SEAL_NAME_LEN_AT, 5, "pinned") == 1
    assert r.take() == [frames.seal(5, b"pinned", bytes(64))]
    w.close()
    r.close()
    with pytest.raises(BufferError):
        m.close()
    sealing.unpin(held)
    with pytest.raises(ValueError, match="used after its release"):
        native.ring_put(held, awake.mapping, ahead, frames.SEAL_NAME_LEN_AT, 6, "late")
    m.close()


def test_a_map_pinned_read_only_is_not_written_through():
    """A read-only map (as a client maps its directory) pinned serves no write."""
    import os

    fd = os.memfd_create("ro-page")
    os.ftruncate(fd, requests.AT + requests.LENGTH)
    m = mmap.mmap(fd, requests.AT + requests.LENGTH, access=mmap.ACCESS_READ)
    os.close(fd)
    held = native.Pinned(m)
    try:
        with pytest.raises(BufferError, match="pinned read-only"):
            native.ring_put(held, _awake_for(1).mapping, frames.seal(0, b"", bytes(64)), frames.SEAL_NAME_LEN_AT, 1, "x")
        assert bytes(m[requests.AT: requests.AT + 8]) == bytes(8)   # (the head: nothing counted)
    finally:
        held.release()
        m.close()
