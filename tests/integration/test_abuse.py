"""A broker that holds under abuse (issue 31): each attack through real sockets on a real broker."""

import math
import os
import socket
import time

import pytest
import zmq

import ipcpool
from ipcpool import fdpass, protocol
from tests.support.uids import NOBODY, connected_as

BIG_META = {"user": {f"k{i}": "x" * 900 for i in range(60)}}   # ~55 KB: just under a request's limit


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


class RawSession:
    """A session opened by hand: its control socket and a DEALER that reads only when told."""

    def __init__(self, socket_dir, rcvhwm: int = 1, connect: bool = True):
        self.control = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.control.connect(str(socket_dir / "broker.sock"))
        fdpass.send(self.control, {"op": "hello", "version": protocol.PROTOCOL_VERSION})
        hello, _ = fdpass.recv(self.control)
        self.ctx = zmq.Context()
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.IDENTITY, hello["token"])
        self.dealer.setsockopt(zmq.RCVHWM, rcvhwm)   # its own queue stays small: the broker's fills
        self.dealer.setsockopt(zmq.LINGER, 0)
        if connect:   # (a token whose DEALER is connected is taken by its pipe: another is refused)
            self.dealer.connect(hello["endpoint"])
        self.token = hello["token"]
        self.next_id = 1

    def send(self, op, **fields):
        self.dealer.send(protocol.pack({"op": op, "id": self.next_id, **fields}))
        self.next_id += 1

    def replies(self, timeout: float = 5.0):
        out = []
        while self.dealer.poll(int(timeout * 1000)):
            out.append(protocol.unpack(self.dealer.recv(), protocol.MAX_REPLY))
            timeout = 0.5
        return out

    def close(self):
        self.dealer.close()
        self.ctx.term()
        self.control.close()


def _objects(c, n, prefix="big/", meta=BIG_META):
    for i in range(n):
        buf = c.create(f"{prefix}{i:04d}", 512, meta=meta)
        buf.seal()
    c.flush()


# 1 --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_unread_replies_are_bounded_in_bytes(start_broker):
    """A session that asks for large replies and never reads them: the broker queues at most its
    budget (32 MiB), answers the rest with an error naming the limit, and its RSS stays put."""
    b = start_broker()
    with ipcpool.connect(b.socket_dir) as c:
        _objects(c, 100)   # a list page of them: ~5.5 MB
    before = rss_kib(b.pid)
    raw = RawSession(b.socket_dir)
    try:
        for _ in range(100):   # 550 MB of replies were it all queued
            raw.send("list", prefix="big/")
        with ipcpool.connect(b.socket_dir) as c:   # the broker answered all 100 meanwhile
            c.stats()
        time.sleep(0.5)
        grown_mib = (rss_kib(b.pid) - before) / 1024
        assert grown_mib < 120, f"broker RSS grew {grown_mib:.0f} MiB"
        got = raw.replies()
        refused = [r for r in got if not r["ok"]]
        assert len(got) == 100 and len(refused) >= 90
        assert "unread_bytes_per_session" in refused[0]["error"], refused[0]
    finally:
        raw.close()


# 2 --------------------------------------------------------------------------------------------
def test_reply_over_max_reply_is_refused_and_its_leases_released(start_broker):
    b = start_broker()
    with ipcpool.connect(b.socket_dir, timeout=5) as c:
        _objects(c, 310)   # a get_many of them all: ~17 MB, over the 16 MiB a reply may have
        names = [f"big/{i:04d}" for i in range(310)]
        t0 = time.monotonic()
        with pytest.raises(ipcpool.QuotaExceeded, match=f"over the limit of {protocol.MAX_REPLY} bytes a reply may have"):
            c.get_many(names)
        assert time.monotonic() - t0 < 3, "the refusal came only after a timeout"
        assert c.stats()["objects"] == 310   # the client goes on
        for name in names:   # no lease was left behind: deleting frees the memory at once
            c.delete(name)
        row = c.stats()["pools"]["default"]
        assert row["used"] == row["arena_bytes"], row   # only this session's arena is left


# 3 --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_thousands_of_pipelined_creates_settle(start_broker):
    b = start_broker()
    with ipcpool.connect(b.socket_dir, timeout=20) as c:
        for i in range(20000):
            c.create(f"p/{i:05d}-{'n' * 200}", 512).seal()
        c.flush()
        assert not c.async_errors
        assert c.stats()["objects"] == 20000


# 4 --------------------------------------------------------------------------------------------
def test_a_request_over_max_message_is_refused_before_it_is_sent(start_broker):
    b = start_broker()
    with ipcpool.connect(b.socket_dir, timeout=5) as c:
        meta = {"user": {f"k{i}": "y" * 1024 for i in range(64)}}   # ~67 KB of metadata
        t0 = time.monotonic()
        with pytest.raises(ipcpool.InvalidRequest, match=f"over the limit of {protocol.MAX_MESSAGE} bytes a request may have"):
            c.create("too/big", 512, meta=meta)
        assert time.monotonic() - t0 < 1
        names = [f"n/{i:04d}-{'z' * 62}" for i in range(1024)]   # 70 characters each: 73 KB in one request
        _objects(c, 0)
        for name in names:
            c.create(name, 64).seal()
        c.flush()
        got = c.get_many(names)   # split by bytes
        assert len(got) == 1024
        for buf in got:
            c.release(buf)


# 5 --------------------------------------------------------------------------------------------
def test_bare_zmq_connections_do_not_cut_open_sessions(start_broker):
    b = start_broker()
    ctx = zmq.Context()
    bare = []
    try:
        with ipcpool.connect(b.socket_dir, timeout=3) as c:
            c.stats()
            for i in range(100):
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(f"ipc://{b.socket_dir / 'broker.zmq'}")
                s.send(b"\x81\xa2op\xa4ping")   # no session: a few error replies at most
                bare.append(s)
            for _ in range(200):   # every request answered, none lost
                c.stats()
            with ipcpool.connect(b.socket_dir, timeout=3) as other:
                other.stats()
        assert "message channel closed" not in b.log()
    finally:
        for s in bare:
            s.close()
        ctx.term()


# 6 --------------------------------------------------------------------------------------------
def test_idle_control_connections_do_not_lock_honest_clients_out(start_broker):
    b = start_broker()
    idle = []
    try:
        for _ in range(1100):   # more than the broker's pending cap, never saying hello
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(str(b.socket_dir / "broker.sock"))
            idle.append(s)
        for _ in range(20):
            with ipcpool.connect(b.socket_dir, timeout=3) as c:
                c.stats()
        assert "without a hello" in b.log()
    finally:
        for s in idle:
            s.close()


# 7 --------------------------------------------------------------------------------------------
def _seal_time(c, prefix, n=200):
    t0 = time.perf_counter()
    for i in range(n):
        c.create(f"{prefix}{i}", 64).seal()
    c.flush()
    return time.perf_counter() - t0


def test_a_session_with_thousands_of_watches_costs_each_seal_once(start_broker):
    b = start_broker()
    with ipcpool.connect(b.socket_dir) as writer, ipcpool.connect(b.socket_dir) as watcher:
        quiet = _seal_time(writer, "q/")
        subs = [watcher.subscribe("") for _ in range(4096)]   # and it never reads
        loud = _seal_time(writer, "w/")
        assert loud < 3 * quiet + 0.2, f"{loud:.3f} s with the watches against {quiet:.3f} s without"
        assert subs[0].next(5)["name"] == "w/0" and subs[-1].next(5)["name"] == "w/0"


# 8 --------------------------------------------------------------------------------------------


def _as_nobody(socket_dir, act) -> str:
    """What ``act(client)`` says as uid nobody, or any error it raised."""
    return connected_as(socket_dir, NOBODY, NOBODY, [], act, timeout=5, catch=(Exception,))


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="runs a client as another uid")


@pytest.fixture
def open_dir(tmp_path_factory):
    import shutil
    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp(prefix="ipcpool-abuse-"))
    os.chmod(d, 0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _open_up(b):
    os.chmod(b.socket_dir, 0o755)
    for name in ("broker.sock", "broker.zmq"):
        os.chmod(b.socket_dir / name, 0o666)


@needs_root
def test_a_pool_goes_only_to_the_uids_its_config_names(start_broker, open_dir):
    config = f"""
[access]
uids = [0, {NOBODY}]
[[pools]]
name = "default"
[[pools]]
name = "secret"
uids = [0]
"""
    b = start_broker(config_text=config, socket_dir=open_dir / "s")
    _open_up(b)
    out = _as_nobody(b.socket_dir, lambda c: repr(c._channel.pool_names))
    assert out == "('default',)", out
    out = _as_nobody(b.socket_dir, lambda c: str(c.allocate(4096, pool="secret")))
    assert out.startswith(f"PeerRefused uid {NOBODY} may not use pool 'secret'"), out
    with ipcpool.connect(b.socket_dir) as c:   # root may, and puts an object there
        buf = c.create("s/obj", 4096, pool="secret")
        buf.seal()
        c.flush()
    out = _as_nobody(b.socket_dir, lambda c: str(c.get("s/obj")))
    assert out.startswith(f"PeerRefused uid {NOBODY} may not use pool 'secret'"), out
    out = _as_nobody(b.socket_dir, lambda c: f"OK {c.allocate(4096).pool}")
    assert out == "OK default", out


# 10 -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("timeout", [math.inf, math.nan, 3e6, -1])
def test_get_with_an_impossible_timeout_is_refused_before_it_is_sent(broker, timeout):
    with ipcpool.connect(broker.socket_dir) as c:
        with pytest.raises(ipcpool.InvalidRequest, match="timeout is None"):
            c.get("never/made", timeout=timeout)
        assert c.stats()["sessions"] == 1


@pytest.mark.slow
def test_creates_and_stats_cost_the_same_with_many_objects(start_broker):
    b = start_broker(config_text="[quotas.default]\nobjects = 100000\n")
    with ipcpool.connect(b.socket_dir, timeout=30) as c:
        def per_create(prefix, n=300):
            t0 = time.perf_counter()
            for i in range(n):
                c.create(f"{prefix}{i}", 64).seal()
            c.flush()
            return (time.perf_counter() - t0) / n
        first = per_create("a/")
        for i in range(30000):
            c.create(f"fill/{i}", 64).seal()
        c.flush()
        later = per_create("b/")
        # A scan of 30,000 objects per create took ~8 ms here; noise on a shared machine, a few 100 µs.
        assert later < max(5 * first, 2e-3), f"{later * 1e6:.0f} µs a create with 30k objects against {first * 1e6:.0f}"


def test_a_client_whose_broker_was_killed_stops_succeeding(start_broker):
    b = start_broker()
    with ipcpool.connect(b.socket_dir, timeout=5) as c:
        c.allocate(512).free()
        b.kill()
        t0 = time.monotonic()
        with pytest.raises(ipcpool.BrokerGone, match="went away"):
            while time.monotonic() - t0 < 3:
                c.allocate(512).free()   # carved from its arena: sent without waiting
        assert time.monotonic() - t0 < 0.5


@needs_root
def test_a_session_token_from_another_uids_connection_is_refused(start_broker, open_dir):
    b = start_broker(config_text=f"[access]\nuids = [0, {NOBODY}]\n", socket_dir=open_dir / "s")
    _open_up(b)
    # Root's session; its DEALER never connects. (One that connected and closed races the attack:
    # until the ROUTER has dropped its pipe, a second peer with the same identity is refused by
    # ZeroMQ itself and hears nothing, which is not the check this test is about.)
    victim = RawSession(b.socket_dir, connect=False)
    victim.dealer.close()
    token = victim.token

    def attack(c):
        ctx = zmq.Context()
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.IDENTITY, token)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(f"ipc://{b.socket_dir / 'broker.zmq'}")
        d.send(protocol.pack({"op": "stats", "id": 1}))
        reply = protocol.unpack(d.recv(), protocol.MAX_REPLY) if d.poll(5000) else {"error": "no reply"}
        d.close()
        ctx.term()
        return str(reply.get("error", "ANSWERED"))

    try:
        out = _as_nobody(b.socket_dir, attack)
        assert "belongs to another uid's session" in out, out
    finally:
        victim.ctx.term()
        victim.control.close()
