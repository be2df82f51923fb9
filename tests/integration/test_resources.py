"""What one process may hold (issue 12, item 3): a dropped client's session ends when it is
collected, sessions and parked gets are capped per uid, the broker refuses new sessions near its
limit of open files instead of dying, and parked gets cost other clients nothing."""

import functools
import gc
import os
import resource
import subprocess
import time

import pytest

import ipcpool
from ipcpool import fdpass, protocol
from tests.support.broker import BrokerProc
from tests.support.fds import fd_count
from tests.support.raw import control
from tests.support.waiting import wait_for


def test_a_client_collected_without_close_ends_its_session(broker):
    with ipcpool.connect(broker.socket_dir) as watcher:
        watcher.stats()                            # (its ZeroMQ connection is made by then)
        baseline = fd_count(broker.pid)
        c = ipcpool.connect(broker.socket_dir)
        c.allocate(1 << 20)                        # held by the client (and it by the buffer)
        c.create("dropped/x", 4096)                # an object it never sealed
        assert watcher.stats()["sessions"] == 2
        with pytest.warns(ResourceWarning, match="was not closed"):
            del c
            gc.collect()
        # Ended now, while this process lives on (before, the broker waited for it to exit).
        wait_for(lambda: watcher.stats()["sessions"] == 1, timeout=2)
        assert watcher.stats()["pools"]["default"]["used"] == 0
        assert watcher.list("dropped/") == []      # its unsealed object was aborted
        wait_for(lambda: fd_count(broker.pid) <= baseline)
    assert "bye" in broker.log() or "closed" in broker.log()


def test_a_forked_child_never_ends_its_parents_session(broker):
    with ipcpool.connect(broker.socket_dir) as c:
        pid = os.fork()
        if pid == 0:   # the child's copy of the client is collected: nothing may reach the broker
            try:
                import warnings

                warnings.simplefilter("ignore")
                del c
                gc.collect()
            finally:
                os._exit(0)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        assert c.stats()["sessions"] == 1
        with c.allocate(4096):
            pass


def test_sessions_per_uid_are_capped(start_broker):
    b = start_broker(config_text="[limits]\nsessions_per_uid = 3\n")
    clients = [ipcpool.connect(b.socket_dir) for _ in range(3)]
    try:
        with pytest.raises(ipcpool.QuotaExceeded, match="sessions_per_uid"):
            ipcpool.connect(b.socket_dir)
        clients.pop().close()
        with ipcpool.connect(b.socket_dir) as c:   # room again
            assert c.stats()["sessions"] == 3
    finally:
        for c in clients:
            c.close()


def test_parked_gets_are_capped_per_uid_and_cost_others_nothing(start_broker):
    b = start_broker(config_text="[limits]\nwaits_per_uid = 2000\n")
    with control(b) as s:   # one raw session parks as many gets as it may
        fdpass.send(s, {"op": "hello", "version": protocol.PROTOCOL_VERSION})
        hello, _ = fdpass.recv(s)
        import zmq

        ctx = zmq.Context()
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.IDENTITY, hello["token"])
        d.setsockopt(zmq.RCVTIMEO, 10_000)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(hello["endpoint"])
        try:
            with ipcpool.connect(b.socket_dir, arena_bytes=0) as other:
                def p50() -> float:
                    times = []
                    for _ in range(300):
                        t0 = time.perf_counter()
                        other.allocate(4096).free()
                        times.append(time.perf_counter() - t0)
                    return sorted(times)[len(times) // 2]

                before = p50()
                for i in range(2000):   # half wait without a deadline, half with a long one
                    msg = {"op": "get", "id": i + 1, "name": f"never/{i % 50}"}
                    if i % 2:
                        msg["timeout_ms"] = 600_000
                    d.send(protocol.pack(msg))
                d.send(protocol.pack({"op": "get", "id": 9999, "name": "never/x", "timeout_ms": 1000}))
                reply = protocol.unpack(d.recv(), protocol.MAX_REPLY)
                assert reply["id"] == 9999 and reply["code"] == ipcpool.QuotaExceeded.code
                assert "waits_per_uid" in reply["error"]
                with pytest.raises(ipcpool.QuotaExceeded, match="waits_per_uid"):   # the same uid
                    other.get("never/y", timeout=5)
                after = p50()
                assert after < max(3 * before, before + 0.0005), (before, after)
                other.put_tensor("never/7", __import__("numpy").arange(4))   # settles 40 of them
                got = [protocol.unpack(d.recv(), protocol.MAX_REPLY) for _ in range(40)]
                assert all(r["ok"] and r["name"] == "never/7" for r in got)
                assert {r["id"] for r in got} == {i + 1 for i in range(2000) if i % 50 == 7}
        finally:
            d.close()
            ctx.term()


def limited(n: int):
    return functools.partial(subprocess.Popen, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)))


def test_near_its_fd_limit_the_broker_refuses_new_sessions_and_lives(tmp_path):
    b = BrokerProc(tmp_path / "s", "host", None, tmp_path / "b.log", launch=limited(256))
    clients = []
    try:
        b.wait_ready()
        refused = None
        for _ in range(200):   # each session takes about three of its 256 files
            try:
                clients.append(ipcpool.connect(b.socket_dir, timeout=10))
            except ipcpool.BrokerBusy as exc:
                refused = exc
                break
        assert refused is not None and "limit of 256 open files" in str(refused)
        assert 40 < len(clients) < 85
        for c in clients:   # every session still served
            assert c.stats()["sessions"] == len(clients)
        assert b.proc.poll() is None
        for c in clients[:10]:
            c.close()
        del clients[:10]
        with ipcpool.connect(b.socket_dir) as c:   # room again
            with c.allocate(4096):
                pass
    finally:
        for c in clients:
            c.close()
        assert b.stop() == 0, b.log()
    assert "near the limit of 256 open files" in b.log()


def test_a_flood_of_raw_message_channel_connections_does_not_kill_the_broker(tmp_path):
    """libzmq aborts the process when its accept() finds no free file: the broker closes that
    listener before it can come to that, and opens it again once files are free."""
    import zmq

    b = BrokerProc(tmp_path / "s", "host", None, tmp_path / "b.log", launch=limited(256))
    ctx = zmq.Context()
    flood = []
    try:
        b.wait_ready()
        with ipcpool.connect(b.socket_dir) as c:
            c.stats()
            for _ in range(400):   # no session needed: anyone who can reach the socket file
                d = ctx.socket(zmq.DEALER)
                d.setsockopt(zmq.LINGER, 0)
                d.connect(f"ipc://{b.socket_dir / 'broker.zmq'}")
                d.send(b"x")
                flood.append(d)
            time.sleep(1.5)
            assert b.proc.poll() is None, b.log()[-2000:]
            assert "message channel closed to new connections" in b.log()   # the guard engaged
            try:   # refused while the listener is closed, served in a moment it is open: alive
                ipcpool.connect(b.socket_dir, timeout=5).close()
            except ipcpool.BrokerBusy:
                pass
            for d in flood:
                d.close()
            flood.clear()
            wait_for(lambda: "open to new connections again" in b.log(), timeout=10)
        deadline = time.monotonic() + 10
        while True:   # the flood's last connections go; then new sessions are served again
            try:
                with ipcpool.connect(b.socket_dir, timeout=5) as c2:
                    with c2.allocate(4096):
                        assert c2.stats()["sessions"] == 1
                break
            except ipcpool.BrokerBusy:
                assert time.monotonic() < deadline
                time.sleep(0.2)
    finally:
        for d in flood:
            d.close()
        ctx.term()
        assert b.stop() == 0, b.log()[-3000:]
    assert "message channel closed to new connections" in b.log()


def test_watches_are_capped_per_uid_and_found_by_prefix(start_broker):
    import numpy as np

    b = start_broker(config_text="[limits]\nwatches_per_uid = 5\n")
    with ipcpool.connect(b.socket_dir) as c:
        subs = [c.subscribe(p) for p in ("", "w/", "w/a", "w/a/b", "x/")]
        with pytest.raises(ipcpool.QuotaExceeded, match="watches_per_uid"):
            c.subscribe("w/")
        c.put_tensor("w/a/b/c", np.arange(3))
        seen = [s.next(timeout=2) for s in subs[:4]]
        assert all(o is not None and o["name"] == "w/a/b/c" for o in seen)
        assert subs[4].next(timeout=0.2) is None        # another prefix: not told
        subs.pop().close()
        with c.subscribe("w/a/b/c") as exact:            # room again; an exact name is a prefix too
            c.put_tensor("w/a/b/c2", np.arange(2))
            assert exact.next(timeout=2)["name"] == "w/a/b/c2"
        for s in subs:
            s.close()


def _fd_slots(pid: int | str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith("FDSize:")))


@pytest.mark.skipif(resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 1024, reason="needs a soft limit of 1024 files")
def test_client_and_broker_size_their_fd_tables_before_any_reply_brings_fds(broker):
    """A reply's FDs must not grow a table on the request's path (fdpass.presize_table): a fresh
    client's table holds FD_TABLE slots once connected, the broker's its own (or its limit)."""
    from ipcpool._client.channel import FD_TABLE
    from ipcpool.broker.server import FD_TABLE as BROKER_TABLE

    code = ("import sys, ipcpool\nc = ipcpool.connect(sys.argv[1])\n"
            "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('FDSize:')))\nc.close()")
    out = subprocess.run([os.sys.executable, "-c", code, str(broker.socket_dir)], capture_output=True, text=True,
                         timeout=60, check=True)
    assert int(out.stdout) >= FD_TABLE
    with open(f"/proc/{broker.pid}/limits") as f:
        broker_limit = int(next(line.split()[3] for line in f if line.startswith("Max open files")))
    assert _fd_slots(broker.pid) >= min(BROKER_TABLE, broker_limit)
