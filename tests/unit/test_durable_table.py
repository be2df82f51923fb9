"""The stored object table: a snapshot plus one record per change, replayed at start. A seal
appends one row (its cost does not grow with the number of objects); records are folded into a
fresh snapshot once they outgrow it; a torn last record is ignored."""

import os
from types import SimpleNamespace

from ipcpool.backend.base import Export
from ipcpool.broker import durable


class _Notifier:   # systemd's side of the FD store is not what this tests
    enabled = True

    def notify(self, *fields, fds=()):
        pass


def _obj(name: str) -> SimpleNamespace:
    pool = SimpleNamespace(spec=SimpleNamespace(name="default"), chunk_fds=lambda handle: [])
    alloc = SimpleNamespace(export=Export(size=4096, offset=4096 * len(name)), pool=pool, uid=0, handle=None)
    return SimpleNamespace(name=name, sealed=True, alloc=alloc, fdkey=None, meta={"user": {"n": name}}, created=1.0)


def _stored(d: durable.Durability) -> dict:
    return durable.replay(os.pread(d._meta_fd, os.fstat(d._meta_fd).st_size, 0))


def test_each_seal_appends_a_row_and_the_table_replays_to_the_live_objects():
    d = durable.Durability(_Notifier(), inherited={})
    live = SimpleNamespace(objects={})
    d.store(SimpleNamespace(pools={}))
    d.tables(live, SimpleNamespace(by_name={}))
    d.save()
    sizes = []
    for i in range(3000):
        obj = live.objects[f"o/{i}"] = _obj(f"o/{i}")
        d.record_object(obj)
        if i % 3 == 0:
            d.forget_object(live.objects.pop(f"o/{i // 2}", obj))
        sizes.append(os.fstat(d._meta_fd).st_size)
    stored = _stored(d)
    assert sorted(r["name"] for r in stored["objects"]) == sorted(live.objects)
    assert stored["objects"][0]["meta"]["user"]["n"] == stored["objects"][0]["name"]
    growth = [b - a for a, b in zip(sizes, sizes[1:]) if b > a]
    assert max(growth) < 200 or len([g for g in growth if g > 200]) < 10   # rows, except a few snapshots
    assert max(sizes) < 4 * max(durable.COMPACT_MIN, 2 * sizes[-1])       # folded, never unbounded
    d.close()


def test_a_torn_last_record_is_ignored_and_version_1_still_reads():
    d = durable.Durability(_Notifier(), inherited={})
    live = SimpleNamespace(objects={"a": _obj("a")})
    d.store(SimpleNamespace(pools={}))
    d.tables(live, SimpleNamespace(by_name={}))
    d.save()
    live.objects["b"] = _obj("b")
    d.record_object(live.objects["b"])
    size = os.fstat(d._meta_fd).st_size
    os.pwrite(d._meta_fd, b"\x81\xa2+o\x8b", size)   # a crash in the middle of the next append
    assert sorted(r["name"] for r in _stored(d)["objects"]) == ["a", "b"]
    d.close()
    import msgpack

    old = msgpack.packb({"version": 1, "objects": [{"name": "x"}], "growables": [], "pools": {}})
    assert durable.replay(old)["objects"] == [{"name": "x"}]
    assert durable.replay(msgpack.packb({"version": 9})) == {}
