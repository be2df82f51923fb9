"""How a client groups the chunk FDs it asks for (``Channel.allocs_fds``): as many allocations a
reply as fit in FD_BATCH, one too large alone batch by batch, and nothing left open on a bad reply.
The control socket is a stand-in here; the broker's side is tested against a real broker."""

from __future__ import annotations

import os

import pytest

from ipcpool import protocol
from ipcpool._client.channel import Channel
from ipcpool.errors import ProtocolError
from tests.support.fds import is_open


def _fds(n: int) -> list[int]:
    return [os.open(os.devnull, os.O_RDONLY) for _ in range(n)]


class FakeControl:
    def __init__(self, counts: dict[int, int], lie: bool = False):
        self.counts, self.lie, self.asked, self.given = counts, lie, [], []

    def control_call(self, msg):
        assert msg["op"] == "alloc_fds"
        self.asked.append(list(msg["allocs"]))
        counts = [self.counts[a] for a in msg["allocs"]]
        fds = _fds(sum(counts) - (1 if self.lie else 0))
        self.given += fds
        return {"ok": True, "counts": counts}, fds

    def alloc_fds(self, aid, count):
        self.asked.append(("alone", aid))
        fds = _fds(count)
        self.given += fds
        return fds


def test_allocations_are_grouped_by_what_one_reply_carries():
    b = protocol.FD_BATCH
    counts = {1: b // 2, 2: b // 2, 3: 1, 4: b + 1, 5: 1}
    fake = FakeControl(counts)
    got = Channel.allocs_fds(fake, list(counts.items()))
    assert fake.asked == [("alone", 4), [1, 2], [3, 5]]
    assert {a: len(f) for a, f in got.items()} == counts
    assert sorted(fd for f in got.values() for fd in f) == sorted(fake.given)
    for fd in fake.given:
        os.close(fd)


def test_a_reply_whose_counts_do_not_match_its_fds_closes_everything():
    fake = FakeControl({1: 2, 2: 3}, lie=True)
    with pytest.raises(ProtocolError, match="alloc_fds reply: its counts do not match its FDs"):
        Channel.allocs_fds(fake, [(1, 2), (2, 3)])
    assert fake.given and not any(is_open(fd) for fd in fake.given)
