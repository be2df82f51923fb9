"""The hand-off on the host backend: a reader that asks before the seal finds the object in its
pool's directory and sees the seal on the board; garbage on a board stays in its pool; short-lived writers do not
multiply memory; small allocations need no round trip."""

import os
import threading
import time

import pytest

import ipcpool
from ipcpool.shm import sealboard
from tests.support.procs import SPAWN, run_together
from tests.support.counting import count_requests

MiB = 1 << 20
TWO_POOLS = '[[pools]]\nname = "default"\nmax_size = "1G"\n\n[[pools]]\nname = "other"\nmax_size = "1G"\n'


def _reader(socket_dir, name, asking, out):
    with ipcpool.connect(socket_dir) as c:
        c.stats()   # (the connect's ping answered: nothing of the set-up is counted below)
        sent = count_requests(c)
        asking.set()
        lease = c.get(name, timeout=30)
        out.put(("reader", (bytes(lease.view[:4]), lease.view[MiB - 1], sent["get"])))
        lease.release()


def _writer(socket_dir, name, asking, out):
    with ipcpool.connect(socket_dir) as c:
        buf = c.create(name, MiB)
        assert asking.wait(60)
        time.sleep(0.5)   # the reader now holds a pending lease and watches the board
        buf.view[:4] = b"seal"
        buf.view[MiB - 1] = 7
        buf.seal()
        c.flush()
        out.put(("writer", buf.carved_at is not None))


def test_a_reader_that_asks_first_sees_the_seal_on_the_board(broker, monkeypatch):
    monkeypatch.setenv("IPCPOOL_GET_SPIN_US", "20000000")   # the reader spins on the directory till then
    asking = SPAWN.Event()
    got = dict(run_together([(_reader, (broker.socket_dir, "h/1", asking)),
                             (_writer, (broker.socket_dir, "h/1", asking))]))
    assert got["writer"] is True
    assert got["reader"] == (b"seal", 7, 0)   # found in the directory before the seal, correct after it


def _abandon(socket_dir, out):
    c = ipcpool.connect(socket_dir)
    c.create("h/gone", MiB)
    out.put(("writer", os.getpid()))
    time.sleep(60)   # killed by the test before it seals


def _get_or_error(c, name):
    try:
        return c.get(name, timeout=20)
    except ipcpool.IpcPoolError as exc:
        return exc


def test_a_writer_killed_before_its_seal_fails_pending_readers(broker):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_abandon, args=(broker.socket_dir, q))
    p.start()
    try:
        q.get(timeout=30)
        with ipcpool.connect(broker.socket_dir) as c:
            got = {}
            reader = threading.Thread(target=lambda: got.setdefault("r", _get_or_error(c, "h/gone")))
            reader.start()
            time.sleep(0.5)   # the reader holds its pending lease: now the writer dies
            t0 = time.monotonic()
            p.kill()
            reader.join(30)
            assert isinstance(got["r"], ipcpool.ObjectAborted), got
            assert "abandoned before it was sealed" in str(got["r"])
            assert time.monotonic() - t0 < 10
            deadline = time.monotonic() + 10
            while c.stats()["pools"]["default"]["used"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert c.stats()["pools"]["default"]["used"] == 0   # the lease went back with the error
    finally:
        p.join(10)


def test_garbage_on_a_board_stays_in_its_pool(start_broker):
    b = start_broker(config_text=TWO_POOLS)
    with ipcpool.connect(b.socket_dir) as bad, ipcpool.connect(b.socket_dir) as w, \
            ipcpool.connect(b.socket_dir) as r:
        for pool in ("default", "other"):
            w.create(f"{pool}/warm", 16, pool=pool).seal()
        bad.allocate(16).free()   # imports "default": its board with it
        garbage = bad._handoff.boards["default"]
        for i in range(sealboard.WORDS):
            garbage.post(i, (i * 0x9E3779B97F4A7C15) & (2**64 - 1))
        # The other pool's board is another file: nothing reached it.
        other = w._handoff.boards["other"]
        assert w._handoff.boards["default"].read(5) == garbage.read(5)
        assert all(other.read(i) in (0, 1) for i in range(sealboard.WORDS))
        # Both pools still serve hand-offs, and the broker is unharmed.
        for pool in ("default", "other"):
            buf = w.create(f"{pool}/x", 64, pool=pool)
            buf.view[:2] = b"ok"
            buf.seal()
            with r.get(f"{pool}/x", timeout=5) as lease:
                assert bytes(lease.view[:2]) == b"ok"
        assert r.stats()["objects"] == 4
        assert sealboard.Board.read(garbage, sealboard.WORDS + 10) == 0   # out of bounds reads nothing


def test_short_lived_writers_do_not_multiply_memory(start_broker):
    b = start_broker(config_text='[[pools]]\nname = "default"\nmax_size = "2G"\n')
    for i in range(300):   # 300 x 32 MiB arenas would be 9.4 GiB: far past the pool
        with ipcpool.connect(b.socket_dir) as c:
            buf = c.create(f"small/{i}", 4096)
            buf.view[:2] = i.to_bytes(2, "little")
            buf.seal()
    with ipcpool.connect(b.socket_dir) as c:
        pool = c.stats()["pools"]["default"]
        assert pool["used"] < 64 * MiB and pool["used"] <= pool["reserved"]
        assert pool["used"] >= 300 * 4096
        with c.get("small/299") as lease:
            assert int.from_bytes(lease.view[:2], "little") == 299
        c.allocate(512 * MiB).free()   # the pool is usable
        for i in range(300):
            c.delete(f"small/{i}")
        deadline = time.monotonic() + 10
        while c.stats()["pools"]["default"]["used"] > 32 * MiB and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.stats()["pools"]["default"]["used"] <= 32 * MiB   # at most this client's arena


def test_small_allocations_need_no_round_trip(broker):
    with ipcpool.connect(broker.socket_dir) as c, ipcpool.connect(broker.socket_dir) as other:
        bufs = [c.allocate(4096) for _ in range(100)]
        assert all(buf.carved_at is not None for buf in bufs)
        bufs[7].view[:3] = b"abc"
        opened = other.open(bufs[7].share())   # sharing waits for the broker's answer
        assert bytes(opened.view[:3]) == b"abc"
        opened.free()
        for buf in bufs:
            buf.free()   # by arena range, without waiting
        c.flush()
        assert c.async_errors == []
        stats = c.stats()["pools"]["default"]
        assert stats["allocations"] == 1 and stats["arena_free"] == stats["arena_bytes"]


def test_an_arena_is_its_sessions_when_it_asks_for_chunk_fds(broker):
    """A session may fetch the FDs of its own arena's memory (a VMM slab's, on CUDA), though the
    arena, not the session, holds it; another session may not. Host memory has no chunks, so
    the arena's owner hears that, not that the arena is not its."""
    with ipcpool.connect(broker.socket_dir) as c, ipcpool.connect(broker.socket_dir) as other:
        c.create("arena/probe", 4096).seal()
        (aid,) = c._handoff._by_arena
        with pytest.raises(ipcpool.InvalidRequest, match=f"allocation {aid} has 0 chunks"):
            c._channel.chunk_fds(0, alloc=aid)
        with pytest.raises(ipcpool.InvalidRequest, match=f"allocation {aid} is not held by this session"):
            other._channel.chunk_fds(0, alloc=aid)


def test_alloc_fds_answers_several_allocations_in_one_reply_and_only_the_sessions(broker):
    """``alloc_fds`` (how a batch attach fetches the VMM slabs it lacks, in one round trip): each
    allocation's chunk FDs and their count, in order (host memory has none); an allocation the
    session does not hold, a list too long and ids that are no ids are refused, and the session
    goes on."""
    with ipcpool.connect(broker.socket_dir, arena_bytes=0) as c, ipcpool.connect(broker.socket_dir) as other:
        bufs = [c.allocate(1 << 20) for _ in range(3)]   # no arena: each an allocation of its own
        aids = [b.alloc_id for b in bufs]
        reply, fds = c._channel.control_call({"op": "alloc_fds", "allocs": aids})
        assert reply["counts"] == [0, 0, 0] and fds == []
        assert c._channel.allocs_fds([(a, 0) for a in aids]) == {a: [] for a in aids}
        with pytest.raises(ipcpool.InvalidRequest, match=f"allocation {aids[1]} is not held by this session"):
            other._channel.control_call({"op": "alloc_fds", "allocs": [aids[1]]})
        with pytest.raises(ipcpool.ProtocolError, match="alloc_fds: field 'allocs' longer than 64"):
            c._channel.control_call({"op": "alloc_fds", "allocs": aids * 22})
        for bad, what in (([], "at least one id"), ([True], r"allocs\[0\]: an id is an int"),
                          ([aids[0], -1], r"allocs\[1\]: an id is an int")):
            with pytest.raises(ipcpool.InvalidRequest, match=what):
                c._channel.control_call({"op": "alloc_fds", "allocs": bad})
        assert c.allocate(4096).size == 4096   # the session goes on
        for b in bufs:
            b.free()


def test_a_steady_writers_next_create_refuses_what_the_usual_create_refuses(broker):
    """The buffer made ready at a writer's last seal serves only a create that is as usual: a bad
    name, a name being written, a non-int size or a closed client get the usual create's error,
    the buffer made ready stays ready, and it serves the next good create."""
    with ipcpool.connect(broker.socket_dir) as c:
        for i in range(3):   # steady: each seal makes the next buffer of this size ready
            c.create(f"steady/{i}", MiB).seal()
        first = c.create("steady/3", MiB)    # (takes the buffer made ready)
        writing = c.create("steady/4", MiB)  # (being written while the next is ready)
        first.seal()
        ready = c._handoff._ahead[0]
        for name, size, error, words in [("../x", MiB, ipcpool.InvalidRequest, "invalid object name"),
                                         (b"steady/5", MiB, ipcpool.InvalidRequest, "a str"),
                                         (["steady/5"], MiB, ipcpool.InvalidRequest, "a str"),
                                         ("steady/4", MiB, ipcpool.ObjectExists, "already writing"),
                                         ("steady/5", float(MiB), ipcpool.InvalidRequest, "positive int")]:
            with pytest.raises(error, match=words):
                c.create(name, size)
            assert c._handoff._ahead[0] is ready
        writing.view[:4] = b"ok!!"
        writing.seal()
        nxt = c.create("steady/5", MiB)
        assert nxt is ready and nxt.carved_at is not None
        nxt.view[:4] = b"next"
        nxt.seal()
        c.flush()
        assert bytes(c.get("steady/5", timeout=5).view[:4]) == b"next"
        assert bytes(c.get("steady/4", timeout=5).view[:4]) == b"ok!!"
    with pytest.raises(ipcpool.ClosedError):
        c.create("steady/6", MiB)
