"""Chunks of the growth stock lent to a grower (ipcpool.broker.loans): grows that take them carry
no chunk FD and keep every byte; a grow another process got in first falls back and keeps the
loan; the loan ends with the last buffer, or with a killed process."""

from __future__ import annotations

import os
import signal
import time

import pytest

import ipcpool
from tests.support.procs import SPAWN

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def as_cupy(ptr: int, n: int):
    import cupy

    mem = cupy.cuda.UnownedMemory(ptr, n, None)
    return cupy.ndarray((n,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))


def fill(g, start: int, end: int, seed: int) -> None:
    import cupy

    as_cupy(g.ptr + start, end - start).fill(seed)
    cupy.cuda.Device().synchronize()


def holds(g, regions) -> bool:
    import cupy

    arr = as_cupy(g.ptr, g.size)
    return all(int(cupy.count_nonzero(arr[a:b] != seed)) == 0 for a, b, seed in regions)


def pool_stats(c) -> dict:
    return c.stats()["pools"]["default"]


def spy_replies(client) -> list[dict]:
    """Record each growable reply's ``took`` and how many chunk FDs it carried (``batch``)."""
    growables, seen = client._growables, []
    real = growables._reply

    def recorded(*args, **kwargs):
        reply, fds = real(*args, **kwargs)
        seen.append({"op_took": reply.took, "batch": len(reply.batch or ()), "lend": len(reply.lend or ())})
        return reply, fds

    growables._reply = recorded
    return seen


def test_a_grower_is_lent_the_stock_and_its_grows_take_it_with_no_chunk_fd(cuda_broker):
    with ipcpool.connect(cuda_broker.socket_dir) as c, ipcpool.connect(cuda_broker.socket_dir) as d:
        seen = spy_replies(c)
        g = c.create_growable("loan/a", 2 * MiB)
        assert seen[0]["lend"] > 0 and pool_stats(c)["lent_bytes"] > 0
        fill(g, 0, g.size, 1)
        regions, size = [(0, 2 * MiB, 1)], 2 * MiB
        while size < 128 * MiB:
            size *= 2
            r = g.grow(size)
            assert r.grown and not r.moved and g.size == size
            fill(g, size // 2, size, len(regions) + 1)
            regions.append((size // 2, size, len(regions) + 1))
        took = [s for s in seen[1:] if s["op_took"]]
        assert len(took) >= 3, seen                       # the loan served most steps
        assert all(s["batch"] == 0 for s in took)         # ... with no chunk FD in their replies
        assert holds(g, regions)
        h = d.attach_growable("loan/a")                   # another session maps the same bytes
        assert h.size == size and holds(h, regions)
        h.close()
        g.close()                                         # c's last buffer: its loan ends
        assert pool_stats(c)["lent_bytes"] == 0
        c.delete_growable("loan/a")


def test_a_grow_another_process_got_in_first_falls_back_and_the_loan_stays(cuda_broker):
    with ipcpool.connect(cuda_broker.socket_dir) as c, ipcpool.connect(cuda_broker.socket_dir) as d:
        seen = spy_replies(c)
        g = c.create_growable("loan/b", 2 * MiB)
        fill(g, 0, 2 * MiB, 1)
        h = d.attach_growable("loan/b")
        h.grow(4 * MiB)                                   # c does not know: it still maps 2 MiB
        fill(h, 2 * MiB, 4 * MiB, 2)
        c._growables._keep_lent()                         # (the create's loan, as c's next grow adds it)
        assert g._mapping.size == 2 * MiB and any(c_.size == 4 * MiB for c_ in c._growables._loans._by_pool["default"].values())
        r = g.grow(6 * MiB)                               # 4 MiB from c's loan, on a stale ``first``
        assert seen[-1]["op_took"] is False and r.grown and g.size == 6 * MiB
        fill(g, 4 * MiB, 6 * MiB, 3)
        assert holds(g, [(0, 2 * MiB, 1), (2 * MiB, 4 * MiB, 2), (4 * MiB, 6 * MiB, 3)])
        r = g.grow(10 * MiB)                              # the loan's 4 MiB chunk, now that c is current
        assert seen[-1]["op_took"] is True and g.size == 10 * MiB
        fill(g, 6 * MiB, 10 * MiB, 4)
        h.sync()
        assert holds(h, [(0, 2 * MiB, 1), (2 * MiB, 4 * MiB, 2), (4 * MiB, 6 * MiB, 3), (6 * MiB, 10 * MiB, 4)])
        h.close()
        g.close()
        c.delete_growable("loan/b")


def _borrow_and_wait(sock, ready):
    c = ipcpool.connect(sock)
    c.create_growable("loan/killed", 2 * MiB)
    ready.put(pool_stats(c)["lent_bytes"])
    time.sleep(600)


@pytest.mark.kills_clients
def test_a_killed_borrowers_loan_is_released_and_the_stock_made_again(cuda_broker):
    with ipcpool.connect(cuda_broker.socket_dir) as c:
        full = pool_stats(c)["stock_bytes"]
        ready = SPAWN.Queue()
        p = SPAWN.Process(target=_borrow_and_wait, args=(cuda_broker.socket_dir, ready))
        p.start()
        assert ready.get(timeout=60) > 0
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        deadline = time.monotonic() + 20
        while (pool_stats(c)["lent_bytes"] or pool_stats(c)["stock_bytes"] < full) and time.monotonic() < deadline:
            time.sleep(0.05)
        row = pool_stats(c)
        assert row["lent_bytes"] == 0 and row["stock_bytes"] == full
        c.delete_growable("loan/killed")


def test_a_create_uses_the_mapping_it_reserved_while_the_broker_made_the_buffer(cuda_broker):
    with ipcpool.connect(cuda_broker.socket_dir) as c:
        backend, made = c.parts.backend, []
        real = backend.prepare_growable

        def prepare(device, span=None):
            made.append(real(device, span))
            return made[-1]

        backend.prepare_growable = prepare
        g = c.create_growable("loan/prepared", 4 * MiB)
        assert made and made[0] is not None and g._mapping is made[0] and g.ptr and g.size == 4 * MiB
        fill(g, 0, g.size, 9)
        assert holds(g, [(0, 4 * MiB, 9)])
        h = c.create_growable("loan/compressed", 4 * MiB, compression=True)   # another granularity
        assert len(made) == 1 and h.size >= 4 * MiB                        # nothing made ahead
        h.close()
        g.close()
        c.delete_growable("loan/prepared")
        c.delete_growable("loan/compressed")
