"""The reply records (``ipcpool.replies``): each encodes to the map the broker sent when replies
were built by hand, byte for byte once packed, and decodes back to itself."""

import pytest

from ipcpool import protocol
from ipcpool.backend.records import Export
from ipcpool.replies import (AbortNotice, AllocFds, Allocation, Arena, Batch, Carved, ChunkFds, GrowableState, GrowNotice,
                             Hello, Lease, PoolFds, ReclaimNotice, Released, SealNotice, Shared, WatchNotice, credits_of)

EV, DATA, CREDIT = b"e" * 64, b"d" * 64, b"c" * 64
EXPORT = Export(4096, 512, DATA, EV, True, (2 << 20,))
FIELDS = {"alloc": 7, "pool": "default", "size": 4096, "offset": 512, "data": DATA, "event": EV, "sub": True,
          "chunks": [2 << 20]}


def same_bytes(record, wire: dict) -> None:
    assert protocol.pack(record.encode()) == protocol.pack(wire)


@pytest.mark.parametrize("record, wire", [
    (Allocation(7, "default", EXPORT), FIELDS),
    (Allocation(7, "default", EXPORT, CREDIT), {**FIELDS, "credit": CREDIT}),
    (Arena(7, "default", EXPORT, (CREDIT,), 256, 300), {**FIELDS, "credits": [CREDIT], "words": 256, "first_seq": 300}),
    (Carved(7, "default", CREDIT), {"alloc": 7, "pool": "default", "credit": CREDIT}),
    (Lease(7, "default", EXPORT, "w/a", {"dtype": "f4"}, CREDIT),
     {**FIELDS, "name": "w/a", "meta": {"dtype": "f4"}, "credit": CREDIT}),
    (Lease(7, "default", EXPORT, "w/a", {}, pending=True, word=3, seq=9),
     {**FIELDS, "name": "w/a", "meta": {}, "pending": True, "word": 3, "seq": 9}),
    (Shared(b"t" * 16), {"token": b"t" * 16}),
    (Hello(b"t" * 16, 4, "host", "ipc:///x", 2, ("default",), {"default": 0}),
     {"token": b"t" * 16, "session": 4, "backend": "host", "endpoint": "ipc:///x", "version": 2,
      "pools": ["default"], "devices": {"default": 0}}),
    (PoolFds({"kind": "host"}, 8192, 0, True), {"info": {"kind": "host"}, "directory": 8192, "pool_index": 0,
                                               "lease_page": True}),
    (ChunkFds([1, 2]), {"chunks": [1, 2]}),
    (AllocFds([1, 0]), {"counts": [1, 0]}),
    (GrowableState("g", 4096, [4096], 1, 5, 11, "default", {"device": -1}, False),
     {"name": "g", "size": 4096, "chunks": [4096], "gen": 1, "word": 5, "stamp": 11, "pool": "default",
      "info": {"device": -1}, "compression_requested": False}),
    (SealNotice(7, EV, "default", CREDIT), {"notify": "sealed", "alloc": 7, "event": EV, "pool": "default",
                                            "credit": CREDIT}),
    (AbortNotice(7, "w/a"), {"notify": "aborted", "alloc": 7, "name": "w/a"}),
    (GrowNotice("g", 2, 8192, 2), {"notify": "grown", "growable": "g", "gen": 2, "size": 8192, "chunks": 2}),
    (ReclaimNotice(3, 1024), {"notify": "reclaim", "arena": 3, "offset": 1024}),
    (WatchNotice(1, {"name": "w/a"}), {"notify": "sealed", "watch": 1, "object": {"name": "w/a"}}),
])
def test_a_record_is_the_map_it_replaced(record, wire):
    same_bytes(record, wire)
    if hasattr(record, "decode"):
        assert type(record).decode(protocol.unpack(protocol.pack(wire), protocol.MAX_REPLY)) == record


def test_a_batch_and_a_release():
    batch = Batch(["default"], [EV], [7, 8], [0, 0], [64, 64], [0, 512], [0, 0], [DATA], [True, True],
                  [(), ()], [{}, {}])
    wire = protocol.unpack(protocol.pack(batch.encode()), protocol.MAX_REPLY)
    assert list(wire) == ["pools", "events", "alloc", "pool", "size", "offset", "data", "datas", "sub", "chunks", "meta"]
    assert Batch.decode(wire).columns()[0] == [7, 8]
    same_bytes(Released("default", CREDIT), {"pool": "default", "credit": CREDIT})
    same_bytes(Released("default"), {"pool": "default"})


def test_a_growable_as_sent_says_what_its_fds_are():
    state = GrowableState("g", 4096, [4096], 1, 5, 11, took=True)
    sent = state.as_sent(True, [4096], [[1, 4096]], "default", {"device": 0})
    wire = sent.encode()
    assert wire["board"] is True and wire["batch"] == [4096] and wire["lend"] == [[1, 4096]] and wire["took"] is True
    assert wire["pool"] == "default" and GrowableState.decode(wire) == sent


def test_credits_and_a_bad_hello():
    assert credits_of({"credit": CREDIT, "pool": "p"}) == ("p", [CREDIT])
    assert credits_of({"credits": [CREDIT, CREDIT], "pool": "p"}) == ("p", [CREDIT, CREDIT])
    assert credits_of({"pool": "p"}) is None and credits_of({"credit": CREDIT}) is None
    with pytest.raises(protocol.ProtocolError, match="token"):
        Hello.decode({"session": 1})
    hello = Hello.decode({"token": b"t", "session": 1, "backend": "host", "endpoint": "e", "pools": ["a"],
                          "devices": {"a": 0, "b": True, 3: 1}})
    assert hello.devices == {"a": 0} and hello.pools == ("a",)
