"""Many clients at once, clients that die, and the broker's FD count."""

import os
import signal
import time

import ipcpool
from tests.support.fds import fd_count
from tests.support.procs import SPAWN, run_procs


def _worker(socket_dir, i, out):
    with ipcpool.connect(socket_dir) as c:
        bufs = [c.allocate(64 << 10) for _ in range(8)]
        for j, b in enumerate(bufs):
            b.view[:] = bytes([(i * 8 + j) % 251]) * b.size
        ok = all(bytes(b.view) == bytes([(i * 8 + j) % 251]) * b.size for j, b in enumerate(bufs))
        peak_sessions = c.stats()["sessions"]
        for b in bufs:
            b.free()
    out.put((i, ok, peak_sessions))


def test_32_clients_at_once(broker):
    results = run_procs(_worker, [(broker.socket_dir, i) for i in range(32)], timeout=240)
    assert sorted(i for i, _, _ in results) == list(range(32))
    assert all(ok for _, ok, _ in results)
    assert max(s for _, _, s in results) > 1   # they really overlapped
    with ipcpool.connect(broker.socket_dir) as c:
        stats = c.stats()
    assert stats["pools"]["default"]["used"] == 0 and stats["sessions"] == 1


def _holder(socket_dir, ready):
    c = ipcpool.connect(socket_dir)
    bufs = [c.allocate(1 << 20) for _ in range(5)]
    for b in bufs:
        b.view[:] = b"x" * b.size
    ready.put(os.getpid())
    time.sleep(600)


def _used(socket_dir):
    with ipcpool.connect(socket_dir) as c:
        s = c.stats()
    return s["pools"]["default"]["used"], s["sessions"]


def _wait_used(socket_dir, want, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        used, sessions = _used(socket_dir)
        if used == want:
            return used, sessions
        time.sleep(0.05)
    return _used(socket_dir)


def test_kill_9_client_is_reclaimed(broker):
    baseline, _ = _used(broker.socket_dir)
    ready = SPAWN.Queue()
    p = SPAWN.Process(target=_holder, args=(broker.socket_dir, ready))
    p.start()
    pid = ready.get(timeout=60)
    used, sessions = _used(broker.socket_dir)
    assert used >= baseline + 5 * (1 << 20) and sessions == 2
    os.kill(pid, signal.SIGKILL)
    p.join(10)
    assert _wait_used(broker.socket_dir, baseline) == (baseline, 1)
    assert f"pid {pid} exited" in broker.log()


def test_orphan_freed_only_once_process_is_gone(broker):
    """A client whose control socket closes while the process lives keeps its memory until exit."""
    ready = SPAWN.Queue()
    p = SPAWN.Process(target=_holder, args=(broker.socket_dir, ready))
    p.start()
    pid = ready.get(timeout=60)
    os.kill(pid, signal.SIGSTOP)       # alive but frozen: nothing must be freed yet
    try:
        time.sleep(0.3)
        assert _used(broker.socket_dir)[0] >= 5 << 20
    finally:
        os.kill(pid, signal.SIGKILL)
    p.join(10)
    assert _wait_used(broker.socket_dir, 0)[0] == 0


def _churn(socket_dir, n, out):
    for i in range(n):
        with ipcpool.connect(socket_dir) as c:
            b = c.allocate(4096)
            if i % 2:
                b.free()   # the other half is freed by close()
    out.put(n)


def _die_holding(socket_dir, out):
    c = ipcpool.connect(socket_dir)
    c.allocate(8192)
    out.put(os.getpid())
    out.close()
    out.join_thread()  # flush the queue before the abrupt exit
    os._exit(0)        # no close, no bye: the broker must notice the exit


def test_no_fd_leak_over_thousands_of_sessions(broker):
    _churn(broker.socket_dir, 20, SPAWN.Queue())   # warm up (first-use allocations in the broker)
    before = fd_count(broker.pid)
    assert sum(run_procs(_churn, [(broker.socket_dir, 500)] * 4, timeout=300)) == 2000
    run_procs(_die_holding, [(broker.socket_dir,)] * 20, timeout=120)
    assert _wait_used(broker.socket_dir, 0) == (0, 1)
    # ZeroMQ closes a departed peer's connection from its I/O thread, a moment later: let it settle.
    deadline = time.monotonic() + 5
    while (after := fd_count(broker.pid)) > before + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert after <= before + 2, f"broker FDs grew from {before} to {after} over 2020 sessions"
