"""Pool statistics, trimming, limits and errors on the host backend, through a real broker."""

import pytest

import ipcpool

MiB = 1 << 20


def pool_stats(c, name="default"):
    return c.stats()["pools"][name]


def test_reserved_follows_writes_and_trim_returns_pages(start_broker):
    b = start_broker(config_text='[[pools]]\nname = "default"\nmax_size = "64M"\n')
    with ipcpool.connect(b.socket_dir, arena_bytes=0) as c:   # exact pool accounting
        s = pool_stats(c)
        assert s == {"reserved": 0, "used": 0, "reserved_high": 0, "used_high": 0, "allocations": 0,
                     "arena_bytes": 0, "arena_free": 0, "growables": 0, "growable_bytes": 0}
        bufs = [c.allocate(4 * MiB) for _ in range(4)]
        s = pool_stats(c)   # sparse: nothing backed before a write, but handed out is reserved
        assert s["reserved"] == s["used"] == 16 * MiB   # (used never shows above reserved)
        for buf in bufs:
            buf.view[:] = b"\x01" * buf.size
        s = pool_stats(c)
        assert s["reserved"] == 16 * MiB and s["used"] == 16 * MiB and s["allocations"] == 4
        for buf in bufs[:3]:
            buf.free()
        c.trim("default", keep=0)
        s = pool_stats(c)
        assert s["reserved"] == 4 * MiB and s["used"] == 4 * MiB
        assert s["reserved_high"] == 16 * MiB and s["used_high"] == 16 * MiB
        c.reset_high()
        s = pool_stats(c)
        assert s["reserved_high"] == 4 * MiB and s["used_high"] == 4 * MiB
        assert bytes(bufs[3].view[:8]) == b"\x01" * 8   # the live one kept its data


def test_release_threshold_trims_on_free(start_broker):
    b = start_broker(config_text='[[pools]]\nname = "default"\nmax_size = "64M"\nrelease_threshold = "2M"\n')
    with ipcpool.connect(b.socket_dir, arena_bytes=0) as c:
        buf = c.allocate(8 * MiB)
        buf.view[:] = b"\x02" * buf.size
        assert pool_stats(c)["reserved"] == 8 * MiB
        buf.free()
        assert pool_stats(c)["reserved"] <= 2 * MiB
        c.set_release_threshold("default", 1 << 40)
        buf = c.allocate(8 * MiB)
        buf.view[:] = b"\x03" * buf.size
        buf.free()
        assert pool_stats(c)["reserved"] == 8 * MiB


def test_named_pools_and_errors(start_broker):
    b = start_broker(config_text=(
        '[[pools]]\nname = "default"\nmax_size = "8M"\n'
        '[[pools]]\nname = "small"\nmax_size = "1M"\n'
        '[quotas.default]\nbytes = "6M"\nobjects = 2\n'
    ))
    with ipcpool.connect(b.socket_dir, arena_bytes=0) as c:
        assert c.pool_names == ("default", "small")
        with c.allocate(512 << 10, pool="small") as buf:
            assert pool_stats(c, "small")["used"] == 512 << 10
            assert buf.pool == "small"
        with pytest.raises(ipcpool.OutOfMemory, match="raise the pool's max_size"):
            c.allocate(2 * MiB, pool="small")
        with pytest.raises(ipcpool.UnknownPool, match="no pool named 'big'; this broker has default, small"):
            c.allocate(10, pool="big")
        held = c.allocate(5 * MiB)
        with pytest.raises(ipcpool.QuotaExceeded, match="quota of 6291456 bytes"):
            c.allocate(2 * MiB)
        held.free()
        c.allocate(2 * MiB).free()                    # the quota is given back on free
        with pytest.raises(ValueError, match="positive"):
            c.allocate(0)
        with pytest.raises(ipcpool.UnknownPool):
            c.trim("nope")
        assert pool_stats(c)["used"] == 0
        c.create("q/1", 10).seal()
        c.create("q/2", 10).seal()
        with pytest.raises(ipcpool.QuotaExceeded, match="has 2 named objects, its quota"):
            c.create("q/3", 10).seal()   # carved from an arena: the refusal comes later
            c.flush()
        c.delete("q/1")
        c.create("q/3", 10).seal()                    # deleting gives the count back
