"""Sizes and lists (issue 12, item 4): huge growables get a clear error, growables count against
their pool's max_size and show in its stats, and lists of any length reach the client."""

import pytest

import ipcpool

MiB = 1 << 20
POOL_64M = '[[pools]]\nname = "default"\nmax_size = "64M"\n'


@pytest.mark.parametrize("nbytes", [2**63, 2**64 - 1, 2**62])
def test_a_huge_growable_is_a_clear_error(broker, nbytes):
    with ipcpool.connect(broker.socket_dir) as c:
        with pytest.raises(ipcpool.InvalidRequest, match="too large") as err:
            c.create_growable("g", nbytes)
        assert "internal" not in str(err.value)
        with c.create_growable("g", MiB) as g:
            with pytest.raises(ipcpool.InvalidRequest, match="too large"):
                g.grow(2**63)
            assert g.size == MiB


def test_growables_respect_the_pools_max_size_and_show_in_its_stats(start_broker):
    b = start_broker(config_text=POOL_64M)
    with ipcpool.connect(b.socket_dir, arena_bytes=0) as c:
        with pytest.raises(ipcpool.OutOfMemory, match="max_size of 67108864"):
            c.create_growable("big", 65 * MiB)
        buf = c.allocate(16 * MiB)
        g = c.create_growable("g", 32 * MiB)
        row = c.stats()["pools"]["default"]
        assert (row["growables"], row["growable_bytes"], row["used"]) == (1, 32 * MiB, 16 * MiB)
        with pytest.raises(ipcpool.OutOfMemory, match="max_size"):
            g.grow(49 * MiB)                 # 16 + 49 > 64
        g.grow(48 * MiB)                     # 16 + 48 = 64: fits exactly
        with pytest.raises(ipcpool.OutOfMemory, match="max_size"):
            c.create_growable("g2", MiB)
        buf.free()
        c.create_growable("g2", 16 * MiB).close()
        c.delete_growable("g2")
        g.close()
        c.delete_growable("g")
        row = c.stats()["pools"]["default"]
        assert (row["growables"], row["growable_bytes"], row["used"]) == (0, 0, 0)
