"""The order of a batch attach's requests (``Leases.get_many``): the next batch is asked for only
once this one's pools and chunk FDs are here, since the broker answers the control socket only
after the requests queued ahead of it (a batch asked for earlier would hold up this one's FDs);
after a reply that names an event, only once it is imported (R4). The channel and the pools are
stand-ins that record what is asked; the broker's side is tested against a real broker, and the
VMM-slab attach on a GPU."""

from __future__ import annotations

import os
import threading

from ipcpool import protocol
from ipcpool._client.leases import Leases
from tests.support.fds import is_open

SLAB = 1 << 20


class Channel:
    def __init__(self, events: bytes = b""):
        self.lock, self.timeout, self.log, self.events = threading.RLock(), 5.0, [], events
        self.batches: dict[int, list[str]] = {}
        self.opened: list[int] = []

    def check_open(self):
        pass

    def send(self, op, **fields):
        rid = len(self.log) + 1
        self.log.append((op, fields.get("names", fields.get("alloc"))))
        if op == "get_many":
            self.batches[rid] = fields["names"]
        return rid

    def wait_reply(self, rid, timeout):
        names = self.batches[rid]
        aids = [int(n[1:]) for n in names]
        # two objects a slab: the first of each slab brings the slab's one chunk FD
        return {"pools": ["p"], "events": [self.events], "datas": [bytes([a // 2]) * 64 for a in aids],
                "alloc": aids, "pool": [0] * len(aids), "size": [64] * len(aids),
                "offset": [(a % 2) * 64 for a in aids], "data": list(range(len(aids))),
                "sub": [True] * len(aids), "chunks": [[SLAB]] * len(aids), "meta": [{}] * len(aids)}

    def allocs_fds(self, wanted):
        self.log.append(("alloc_fds", [aid for aid, _ in wanted]))
        out = {aid: [os.open(os.devnull, os.O_RDONLY) for _ in range(count)] for aid, count in wanted}
        self.opened += [fd for fds in out.values() for fd in fds]
        return out


class Pool:
    def __init__(self, log):
        self.log, self.mapped = log, set()

    def needs_fds(self, export):
        return export.data not in self.mapped

    def import_many(self, exports, stream=None):
        self.log.append(("import_many", len(exports)))
        return [object() for _ in exports]


class Pools:
    def __init__(self, log):
        self.imported, self.boards, self.pool = {}, {}, Pool(log)

    def get(self, name):
        return self.pool

    def import_allocation(self, aid, pool, export, stream, fds):
        for fd in fds:   # the pool takes them over (a VMM slab mapped from its FD)
            os.close(fd)
        self.pool.mapped.add(export.data)
        return object()


class Backend:
    on_gpu = False


def _attach(monkeypatch, events: bytes = b""):
    monkeypatch.setattr(protocol, "MAX_BATCH", 4)
    channel = Channel(events)
    leases = Leases(channel, Pools(channel.log), Backend(), 0)
    got = leases.get_many([f"o{i}" for i in range(8)], stream=None)
    return channel, got


def test_the_next_batch_is_asked_for_once_this_ones_fds_are_here(monkeypatch):
    channel, got = _attach(monkeypatch)
    assert [b.name for b in got] == [f"o{i}" for i in range(8)]
    assert channel.log == [("get_many", ["o0", "o1", "o2", "o3"]), ("alloc_fds", [0, 2]),
                           ("get_many", ["o4", "o5", "o6", "o7"]), ("import_many", 2),
                           ("alloc_fds", [4, 6]), ("import_many", 2)]
    assert channel.opened and not any(is_open(fd) for fd in channel.opened)


def test_after_a_reply_that_names_an_event_the_next_batch_waits_for_its_import(monkeypatch):
    channel, got = _attach(monkeypatch, events=b"e" * 64)
    assert len(got) == 8
    assert channel.log == [("get_many", ["o0", "o1", "o2", "o3"]), ("alloc_fds", [0, 2]), ("import_many", 2),
                           ("get_many", ["o4", "o5", "o6", "o7"]), ("alloc_fds", [4, 6]), ("import_many", 2)]
