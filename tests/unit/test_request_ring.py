"""The request ring's layout logic (``ipcpool.shm.requests``) on one mapping both sides share."""

from __future__ import annotations

import mmap
import struct

import pytest

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
