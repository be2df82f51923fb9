"""Memory written in one process is seen by another, through the broker, zero-copy."""

import hashlib

import numpy as np
import pytest

import ipcpool
from tests.support.procs import SPAWN, run_together

N = 3 << 20


def pattern(seed: bytes, n: int = N) -> bytes:
    return (hashlib.sha256(seed).digest() * (n // 32 + 1))[:n]


def _producer(socket_dir, tokens, acks, out):
    with ipcpool.connect(socket_dir) as c:
        buf = c.allocate(N)
        buf.view[:] = pattern(b"A")
        tokens.put(buf.share())
        acks.get(timeout=60)                       # the consumer wrote back and released
        out.put(bytes(buf.view) == pattern(b"B"))
        buf.free()


def _consumer(socket_dir, tokens, acks, out):
    token = tokens.get(timeout=60)
    with ipcpool.connect(socket_dir) as c:
        with c.open(token) as buf:
            ok = bytes(buf.view) == pattern(b"A")
            buf.view[:] = pattern(b"B")
    acks.put(True)
    out.put(ok)


def test_written_in_one_process_verified_in_another_both_ways(broker):
    tokens, acks = SPAWN.Queue(), SPAWN.Queue()
    results = run_together([(_producer, (broker.socket_dir, tokens, acks)),
                            (_consumer, (broker.socket_dir, tokens, acks))], timeout=60)
    assert results == [True, True]
    with ipcpool.connect(broker.socket_dir) as c:
        assert c.stats()["pools"]["default"]["used"] == 0


def test_numpy_sees_the_same_memory(broker):
    with ipcpool.connect(broker.socket_dir) as c:
        with c.allocate(4096) as buf:
            arr = np.asarray(buf)
            assert arr.dtype == np.uint8 and arr.shape == (4096,)
            arr[:] = 7
            assert bytes(buf.view[:3]) == b"\x07\x07\x07"
            assert arr.__array_interface__["data"][0] == buf.ptr
            assert buf.device is None


def test_memory_outlives_owner_while_opened(broker):
    """The owner frees; the opener still holds the memory; freed only when both let go."""
    with ipcpool.connect(broker.socket_dir, arena_bytes=0) as owner, ipcpool.connect(broker.socket_dir) as other:
        buf = owner.allocate(1 << 20)
        buf.view[:4] = b"keep"
        opened = other.open(buf.share())
        buf.free()
        assert other.stats()["pools"]["default"]["used"] >= 1 << 20
        assert bytes(opened.view[:4]) == b"keep"
        opened.free()
        assert other.stats()["pools"]["default"]["used"] == 0
        with pytest.raises(ipcpool.InvalidRequest, match="no shared allocation"):
            other.open(b"\x00" * 16)


def test_buffer_after_free_and_client_after_close(broker):
    c = ipcpool.connect(broker.socket_dir)
    buf = c.allocate(100)
    assert buf.size == 100
    buf.free()
    buf.free()  # idempotent
    with pytest.raises(ipcpool.ClosedError, match="freed"):
        buf.view
    leftover = c.allocate(100)
    c.close()
    c.close()   # idempotent
    assert leftover.freed
    with pytest.raises(ipcpool.ClosedError, match="closed"):
        c.allocate(1)
    with ipcpool.connect(broker.socket_dir) as c2:
        assert c2.stats()["pools"]["default"]["used"] == 0


def test_unclosed_client_warns(broker):
    import gc

    c = ipcpool.connect(broker.socket_dir)
    with pytest.warns(ResourceWarning, match="not closed"):
        del c
        gc.collect()
