"""Growable buffers on the host backend: real processes follow growth, both mapping paths, lifetime."""

import ctypes
import os
import signal
import time

import pytest

import ipcpool
from ipcpool.backend.host.growable import PAGE, reserve, unmap
from tests.support.procs import SPAWN

MiB = 1 << 20


def fill(view: memoryview, start: int, end: int, seed: int) -> None:
    view[start:end] = bytes((seed + i) % 251 for i in range(256)) * ((end - start) // 256)


def expect(view: memoryview, start: int, end: int, seed: int) -> bool:
    return bytes(view[start:end]) == bytes((seed + i) % 251 for i in range(256)) * ((end - start) // 256)


def follower(sock, name, todo, done):
    """Attach, then on each message: sync, check every region written so far, write the next."""
    with ipcpool.connect(sock) as c:
        g = c.attach_growable(name)
        done.put(("attached", g.size, g.ptr))
        while (msg := todo.get(timeout=60)) != "stop":
            regions = msg
            r = g.sync()
            view = g.view()
            ok = all(expect(view, a, b, seed) for a, b, seed in regions[:-1])
            a, b, seed = regions[-1]
            fill(view, a, b, seed)            # the newest region is the follower's to write
            done.put(("synced", r.grown, r.moved, g.size, ok))
        g.close()


def test_a_follower_sees_every_grow_in_place_and_writes_both_ways(broker):
    todo, done = SPAWN.Queue(), SPAWN.Queue()
    with ipcpool.connect(broker.socket_dir) as c:
        g = c.create_growable("buf/a", 1 * MiB)
        assert g.size == 1 * MiB and g.reserved >= 2 * MiB and not g.compression
        fill(g.view(), 0, MiB, 1)
        p = SPAWN.Process(target=follower, args=(broker.socket_dir, "buf/a", todo, done))
        p.start()
        try:
            assert done.get(timeout=30)[:2] == ("attached", MiB)
            regions = [(0, MiB, 1)]
            for step, size in enumerate((2 * MiB, 4 * MiB, 8 * MiB)):
                old = g.size
                r = g.grow(size)
                assert r.grown and r.size == size and g.size == size
                regions.append((old, size, step + 2))
                todo.put(regions)
                kind, grown, _moved, seen, ok = done.get(timeout=30)
                assert (kind, grown, seen, ok) == ("synced", True, size, True)
                assert expect(g.view(), old, size, step + 2)   # the follower's writes, seen here
            assert all(expect(g.view(), a, b, s) for a, b, s in regions)
            assert c.grow("buf/a", MiB).grown is False          # shrinking is a no-op
        finally:
            todo.put("stop")
            p.join(30)
        assert p.exitcode == 0


def test_growth_past_a_taken_range_moves_and_remaps_every_chunk(broker):
    with ipcpool.connect(broker.socket_dir) as c:
        g = c.create_growable("buf/slow", 2 * MiB)
        fill(g.view(), 0, 2 * MiB, 7)
        r = g.grow(g.reserved)                      # within the reservation: in place
        assert r.grown and not r.moved
        fill(g.view(), 2 * MiB, g.size, 8)
        # Take the range right after ours (unless something already has: mappings grow down),
        # so the next grow cannot extend in place.
        wall = reserve(PAGE, at=g.ptr + g.reserved)
        assert reserve(PAGE, at=g.ptr + g.reserved) is None
        try:
            old_ptr, old_size = g.ptr, g.size
            r = g.grow(old_size * 4)
            assert r.moved and r.old_ptr == old_ptr and r.ptr == g.ptr != old_ptr
            view = g.view()
            assert expect(view, 0, 2 * MiB, 7) and expect(view, 2 * MiB, old_size, 8)
            fill(view, old_size, g.size, 9)
            # The old range still maps the same memory until close.
            old = memoryview((ctypes.c_char * old_size).from_address(old_ptr)).cast("B")
            assert expect(old, 0, 2 * MiB, 7)
            view[0] = 200
            assert old[0] == 200
        finally:
            if wall is not None:
                unmap(wall, PAGE)


def test_lifetime_delete_waits_for_detach_and_quota_counts_growth(start_broker):
    b = start_broker(config_text="[quotas.default]\nbytes = 16777216\n")
    with ipcpool.connect(b.socket_dir) as c, ipcpool.connect(b.socket_dir) as other:
        g = c.create_growable("buf/q", 4 * MiB)
        with pytest.raises(ipcpool.QuotaExceeded, match="quota"):
            g.grow(32 * MiB)
        assert g.size == 4 * MiB                   # a refused grow changes nothing
        h = other.attach_growable("buf/q")
        g.grow(8 * MiB)
        c.delete_growable("buf/q")
        with ipcpool.connect(b.socket_dir) as third, pytest.raises(ipcpool.ObjectNotFound):
            third.attach_growable("buf/q")
        assert h.sync().size == 8 * MiB            # still usable while attached
        fill(h.view(), 0, 8 * MiB, 3)
        g.close()
        (row,) = other.list_growables()
        assert row["state"] == "deleting" and row["attached"] == 1
        h.close()
        assert other.list_growables() == []
        c.create_growable("buf/q", 12 * MiB).close()   # the bytes came back to the quota


def test_bad_growable_requests_get_clear_errors(broker):
    with ipcpool.connect(broker.socket_dir) as c, ipcpool.connect(broker.socket_dir) as d:
        g = c.create_growable("buf/e", MiB)
        with pytest.raises(ipcpool.ObjectExists):
            d.create_growable("buf/e", MiB)
        with pytest.raises(ipcpool.InvalidRequest, match="already attached"):
            c.attach_growable("buf/e")
        with pytest.raises(ipcpool.InvalidRequest, match="not attached"):
            d.grow("buf/e", 2 * MiB)
        with pytest.raises(ipcpool.InvalidRequest, match="not attached"):
            d._channel.call("grow", name="buf/e", nbytes=2 * MiB)
        with pytest.raises(ipcpool.InvalidRequest, match="not attached"):   # FDs only for holders
            d._channel.chunk_fds(0, growable="buf/e")
        with pytest.raises(ipcpool.InvalidRequest, match="has 1 chunks"):
            c._channel.chunk_fds(5, growable="buf/e")
        with pytest.raises(ipcpool.InvalidRequest, match="invalid object name"):
            c.create_growable("../x", MiB)
        with pytest.raises(ValueError):
            g.grow(0)
        g.close()
        with pytest.raises(ipcpool.ClosedError):
            g.grow(2 * MiB)
        assert c.stats()["sessions"] == 2          # the broker kept serving


def holder(sock, name, out):
    c = ipcpool.connect(sock)
    g = c.attach_growable(name)
    fill(g.view(), 0, MiB, 5)
    out.put(os.getpid())
    signal.pause()


def test_a_killed_follower_is_detached_and_the_buffer_released(broker):
    out = SPAWN.Queue()
    with ipcpool.connect(broker.socket_dir) as c:
        g = c.create_growable("buf/k", MiB)
        p = SPAWN.Process(target=holder, args=(broker.socket_dir, "buf/k", out))
        p.start()
        pid = out.get(timeout=30)
        c.delete_growable("buf/k")
        g.close()
        assert c.list_growables()[0]["attached"] == 1
        os.kill(pid, signal.SIGKILL)
        p.join(10)
        for _ in range(100):
            if not c.list_growables():
                break
            time.sleep(0.05)
        assert c.list_growables() == []
