"""A writer's creates through its request ring (``ipcpool.shm.requests``) while the broker busy-polls:
the same objects and refusals as on the socket, never overtaken by the session's later requests, a
sleeping broker nudged, and a ring of garbage ending only its own session."""

from __future__ import annotations

import concurrent.futures
import struct
import time
from collections.abc import Callable

import pytest

import ipcpool
from ipcpool import frames
from ipcpool._client import handoff
from ipcpool.shm import requests
from tests.support.counting import count_requests
from tests.support.waiting import wait_for

KiB = 1024
SPINNING = "busy_poll_us = 100000\n"   # 0.1 s after each request: the ring is read throughout a test


def _count_frames(client) -> Callable[[], dict[str, int]]:
    """Count, from now on, the frames that go through the ring (its head word, where the C and
    Python puts both count), the creates that go on the socket and the nudges: a call says how many."""
    ch, words = client._channel, client._pools.lease_page.ring._words
    seen = {"socket": 0, "nudge": 0}
    send_control, start = ch._send_control, words[requests._HEAD_WORD]

    def counted_send(data):
        if data == frames.NUDGE_FRAME:
            seen["nudge"] += 1
        elif data[1] == frames.CREATE:
            seen["socket"] += 1
        return send_control(data)

    ch._send_control = counted_send
    return lambda: {"ring": words[requests._HEAD_WORD] - start, **seen}


def _warm(w, r):
    buf = w.create("warm", 4 * KiB)
    buf.seal()
    w.flush()
    r.get("warm", timeout=5).release()
    w.delete("warm")


@pytest.mark.parametrize("put", ["C", "Python"])
def test_a_busy_polling_brokers_writer_puts_its_creates_in_the_ring(start_broker, monkeypatch, put):
    """A steady writer's frames are built ahead and completed at its create and seal: in one C
    call where the C part is built (the seal's with its board post: ``put_sealed``), else in
    Python (``frames.completed``); the same frames either way."""
    if put == "C" and requests.put_ready is None:
        pytest.skip("ipcpool's C part is not built here")
    sealed = []
    if put == "Python":
        monkeypatch.setattr(requests, "put_ready", None)
        monkeypatch.setattr(requests, "put_sealed", None)
    else:   # (the C call itself, counted)
        c_seal = requests.put_sealed
        monkeypatch.setattr(requests, "put_sealed", lambda *args: sealed.append(c_seal(*args)) or sealed[-1])
    broker = start_broker(config_text=SPINNING)
    with ipcpool.connect(broker.socket_dir) as w, ipcpool.connect(broker.socket_dir) as r:
        _warm(w, r)
        seen = _count_frames(w)
        for i in range(30):
            buf = w.create(f"ring/{i}", 4 * KiB)
            buf.view[:6] = f"obj{i:03d}".encode()[:6]
            buf.seal()
            w.flush()   # (the ring is empty again before each create)
            lease = r.get(f"ring/{i}", timeout=5)
            assert bytes(lease.view[:6]) == f"obj{i:03d}".encode()[:6]
            lease.release()
        # 30 creates and their seals; a stall of the broker past its busy-poll (a loaded machine)
        # sends a frame or two on the socket instead, and nudges
        got = seen()
        assert got["ring"] >= 50 and got["socket"] <= 5, got
        assert sorted(o["name"] for o in w.list("ring/")) == sorted(f"ring/{i}" for i in range(30))
        if put == "C":   # each seal posted and put in one call (0: posted, its frame on the socket)
            assert len(sealed) >= 25 and all(s in (0, 1, 2) for s in sealed), sealed


def test_creates_in_the_ring_come_before_the_sessions_later_frames_and_requests(start_broker):
    """Creates in the ring, seals on the socket, deletes on the message channel, as fast as the
    writer goes: each is handled after the create it follows (none refused)."""
    broker = start_broker(config_text=SPINNING)
    with ipcpool.connect(broker.socket_dir) as w, ipcpool.connect(broker.socket_dir) as r:
        _warm(w, r)
        seen = _count_frames(w)
        for i in range(200):
            w.create(f"churn/{i}", 16 * KiB).seal()
            if i % 20 == 19:
                w.flush()   # raises the first refusal, if any
                for j in range(i - 19, i + 1):
                    w.delete(f"churn/{j}")
        w.flush()
        assert w.async_errors == [] and w.list("churn/") == []
        assert seen()["ring"] > 0


def _hand_off(w, r, name: str) -> None:
    """One object from writer ``w`` to reader ``r``, its bytes checked; every reply taken in."""
    buf = w.create(name, 4 * KiB)
    buf.view[:5] = b"woken"
    buf.seal()
    lease = r.get(name, timeout=5)
    assert bytes(lease.view[:5]) == b"woken"
    lease.release()
    w.flush()


def test_a_write_after_the_brokers_last_look_is_nudged(start_broker):
    """The broker stopped busy-polling between the writer's look and its write: the writer sends a
    nudge, and the create is handled at once (the broker here never busy-polls at all)."""
    broker = start_broker(config_text="busy_poll_us = 0\n")
    with ipcpool.connect(broker.socket_dir) as w, ipcpool.connect(broker.socket_dir) as r:
        _warm(w, r)
        view, index = w._pools.directories["default"]

        class Dozing:   # awake when the writer looks, asleep when it looks again after the write
            def __init__(self):
                self.looks = [time.monotonic_ns() + 10**9, 0]

            def awake_until(self):
                return self.looks.pop(0) if self.looks else 0

            def __getattr__(self, name):
                return getattr(view, name)

        w._pools.directories["default"] = (Dozing(), index)
        seen = _count_frames(w)
        _hand_off(w, r, "nudged")
        assert seen() == {"ring": 1, "socket": 0, "nudge": 1}   # (the seal then went on the socket)


def test_a_frame_put_ahead_in_c_after_the_brokers_last_look_is_nudged(start_broker, monkeypatch):
    """The C put of a frame built ahead reads the broker's polling moment before and after its
    write; where it passed meanwhile (here: the put sees a directory that says "awake", then the
    moment is said to have passed) the writer sends a nudge after each such put, and the reader
    gets the object."""
    if requests.put_ready is None:
        pytest.skip("ipcpool's C part is not built here")
    from ipcpool.shm import _native

    broker = start_broker(config_text="busy_poll_us = 0\n")   # asleep between requests: only a nudge wakes it
    with ipcpool.connect(broker.socket_dir) as w, ipcpool.connect(broker.socket_dir) as r:
        _warm(w, r)
        awake = bytearray(4096)   # what the C put reads: the broker polls for a long while yet
        struct.pack_into("<Q", awake, _native.AWAKE_AT, 2**63)
        put, put_sealed = requests.put_ready, requests.put_sealed

        def looked_too_late(page, _directory, *args):
            got = put(page, awake, *args)
            return 2 if got == 1 else got   # written; the broker's moment passed meanwhile

        def sealed_too_late(event, stream, board, word, seq, page, _directory, *args):   # (the seal's, with its post)
            got = put_sealed(event, stream, board, word, seq, page, awake, *args)
            return 2 if got == 1 else got

        for k in range(2):   # a steady writer: its next object is made ready, its frames built ahead
            w.create(f"steady/{k}", 4 * KiB).seal()
        w.flush()
        monkeypatch.setattr(requests, "put_ready", looked_too_late)
        monkeypatch.setattr(requests, "put_sealed", sealed_too_late)
        seen = _count_frames(w)
        _hand_off(w, r, "nudged")
        assert seen() == {"ring": 2, "socket": 0, "nudge": 2}   # the create and the seal, each nudged


def test_garbage_in_a_request_ring_ends_only_its_own_session(start_broker):
    broker = start_broker(config_text=SPINNING)
    with ipcpool.connect(broker.socket_dir) as w, ipcpool.connect(broker.socket_dir) as liar:
        _warm(w, liar)
        page = liar._pools.lease_page._map
        struct.pack_into("<Q", page, requests.AT, 10**9)   # a head far past anything written
        deadline = time.monotonic() + 5
        with pytest.raises(ipcpool.IpcPoolError) as err:   # ended: its next request is refused
            while time.monotonic() < deadline:
                liar.stats()
                time.sleep(0.01)
        assert "request ring does not add up (head 1000000000 against 0 taken)" in str(err.value)
        assert "ended the session" in str(err.value)
        w.create("after", 4 * KiB).seal()   # the broker serves on
        w.flush()
        assert [o["name"] for o in w.list()] == ["after"]
    assert "request ring does not add up" in broker.log()


@pytest.mark.parametrize("parked_us", [100_000, 0])
def test_a_parked_get_keeps_the_broker_polling_for_the_create_it_waits_for(start_broker, parked_us):
    """The broker polls without sleeping after a get that parked (busy_poll_parked_us), even with
    no busy-poll after other requests: the create that get waits for, and its seal, go through
    the ring, and the reader gets it. Without it the broker sleeps, and the create goes on the
    socket (which wakes it)."""
    broker = start_broker(config_text=f"busy_poll_us = 0\nbusy_poll_parked_us = {parked_us}\n")
    with ipcpool.connect(broker.socket_dir) as w, ipcpool.connect(broker.socket_dir) as r, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        _warm(w, r)
        view = w._pools.directories["default"][0]
        told = view.awake_until()
        asked = count_requests(r)
        waiting = pool.submit(r.get, "awaited", timeout=10)
        wait_for(lambda: asked["get"] == 1)   # past its spin: the broker parks the get
        if parked_us:   # told in the directory while it polls (the ring's condition)
            wait_for(lambda: view.awake_until() > time.monotonic_ns() + 20_000_000)
        else:
            time.sleep(0.1)
            assert view.awake_until() == told
        seen = _count_frames(w)
        buf = w.create("awaited", 4 * KiB)
        buf.view[:6] = b"parked"
        buf.seal()
        lease = waiting.result(timeout=10)
        assert bytes(lease.view[:6]) == b"parked"
        lease.release()
        w.flush()
        got = seen()
        assert (got["ring"], got["socket"]) == ((2, 0) if parked_us else (0, 1)), got   # (ring: create, seal)


def test_a_create_with_metadata_after_steady_ones_has_its_seal_follow_it(start_broker):
    """A steady writer's next object is made ready with its frames built ahead; a create that
    carries metadata (too large for a frame: the message channel) takes that object, and its seal
    must go the same way, after it, not ahead of it in the ring."""
    broker = start_broker(config_text=SPINNING)
    with ipcpool.connect(broker.socket_dir) as w, ipcpool.connect(broker.socket_dir) as r:
        _warm(w, r)
        big = {"user": {f"k{k}": "x" * 1000 for k in range(frames.MAX_META // 1000 + 1)}}
        for i in range(40):
            buf = w.create(f"mixed/{i}", 4 * KiB, meta=big if i % 4 == 3 else None)
            buf.view[:1] = bytes([i])
            buf.seal()
        w.flush()   # raises the first refusal, if any
        assert w.async_errors == []
        for i in range(40):
            lease = r.get(f"mixed/{i}", timeout=5)
            assert lease.view[0] == i and (lease.meta.get("user") == big["user"]) == (i % 4 == 3)
            lease.release()


def test_a_name_given_up_and_created_again_at_once_is_created_after_its_free(start_broker, monkeypatch):
    """A steady writer gives up an object (its free, a message, aborts it) and creates the name again
    at once: that create must not overtake the free through the ring ("already exists"). It goes
    as a message after the free; the next names go through the ring again."""
    broker = start_broker(config_text=SPINNING)
    with ipcpool.connect(broker.socket_dir) as w, ipcpool.connect(broker.socket_dir) as r:
        _warm(w, r)
        seen = _count_frames(w)
        monkeypatch.setattr(handoff, "FREEING_MAX", 8)   # the names it keeps for that: bounded
        for i in range(20):
            for k in range(3):   # steady: the next object made ready, its frames built ahead
                w.create(f"steady/{i}/{k}", 4 * KiB).seal()
            w.create(f"again/{i}", 4 * KiB).free()
            buf = w.create(f"again/{i}", 4 * KiB)
            buf.view[:1] = bytes([i])
            buf.seal()
            assert len(w._handoff._freeing) <= 8
        w.flush()   # raises the first refusal, if any
        assert w.async_errors == []
        assert seen()["ring"] > 0, seen()   # (a ring full sends frames on the socket for a while)
        for i in range(20):
            lease = r.get(f"again/{i}", timeout=5)
            assert lease.view[0] == i
            lease.release()
