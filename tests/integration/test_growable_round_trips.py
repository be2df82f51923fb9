"""How many requests growable buffers cost (host backend): one round trip to create, attach or
grow, and none for an attached process to follow another's grow."""

import contextlib
import os
import socket
import time

import pytest
import zmq

import ipcpool
from ipcpool import fdpass, paths, protocol

from tests.support.counting import count_requests

MiB = 1 << 20


@contextlib.contextmanager
def grower_and_follower(broker, name: str, nbytes: int):
    """Two sessions: ``c`` creates growable ``name``, ``d`` attaches it. Yields (c, d, g, h)."""
    with ipcpool.connect(broker.socket_dir) as c, ipcpool.connect(broker.socket_dir) as d:
        g = c.create_growable(name, nbytes)
        h = d.attach_growable(name)
        yield c, d, g, h
        h.close()
        g.close()


def test_a_fresh_session_does_not_wait_for_its_message_channel_before_a_growable_request(broker):
    """The connect's ping goes unawaited, and the first growable requests send no ping of their
    own: nothing was sent before them to come after."""
    with ipcpool.connect(broker.socket_dir) as c:
        sent = count_requests(c)
        c.create_growable("rt/p", MiB).close()
        c.create_growable("rt/q", MiB).close()
        assert sent == {"control:grow_create": 2, "grow_detach": 2}


def test_a_growth_notice_waits_in_the_broker_until_the_session_is_heard_on_the_message_channel(broker):
    """A session that attached on the control socket alone is not yet known to the broker's
    ROUTER, which would drop a notice: the broker keeps the newest one per buffer and sends it
    ahead of the answer to the session's first message there."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(str(broker.socket_dir / paths.CONTROL_NAME))
    ctx = zmq.Context()
    try:
        fdpass.send(s, {"op": "hello", "version": protocol.PROTOCOL_VERSION, "id": 1})
        hello, _ = fdpass.recv(s)
        with ipcpool.connect(broker.socket_dir) as c:
            g = c.create_growable("rt/late", MiB)
            fdpass.send(s, {"op": "grow_attach", "name": "rt/late", "id": 2})
            reply, fds = fdpass.recv(s)
            for fd in fds:
                os.close(fd)
            assert reply["ok"] and reply["size"] == MiB
            g.grow(4 * MiB)
            g.grow(8 * MiB)          # two grows before the session is heard: the newest note is kept
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.IDENTITY, hello["token"])
            d.setsockopt(zmq.RCVTIMEO, 5000)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(hello["endpoint"])
            d.send(protocol.pack({"op": "ping", "id": 3}))
            note, answer = protocol.unpack(d.recv()), protocol.unpack(d.recv())
            assert (note["notify"], note["growable"], note["gen"], note["size"]) == ("grown", "rt/late", 2, 8 * MiB)
            assert answer["id"] == 3 and answer["ok"]
            g.grow(16 * MiB)         # heard now: the next note goes at once
            assert protocol.unpack(d.recv())["size"] == 16 * MiB
            g.close()
    finally:
        ctx.destroy(linger=0)   # closes the DEALER too, also when an assertion failed
        s.close()


def test_create_attach_and_grow_are_one_round_trip_each(broker):
    with ipcpool.connect(broker.socket_dir) as c, ipcpool.connect(broker.socket_dir) as d:
        c.stats(), d.stats()   # both sessions have spoken on the message channel (see above)
        sent = count_requests(c)
        g = c.create_growable("rt/a", MiB)
        assert sent == {"control:grow_create": 1} and g.size == MiB
        g.view()[:4] = b"abcd"
        sent.clear()
        r = g.grow(8 * MiB)
        assert sent == {"control:grow": 1}                  # the new size and the FD in one reply
        assert r.grown and g.size == 8 * MiB and bytes(g.view()[:4]) == b"abcd"
        sent = count_requests(d)
        h = d.attach_growable("rt/a")
        assert sent == {"control:grow_attach": 1} and h.size == 8 * MiB
        assert bytes(h.view()[:4]) == b"abcd"
        h.close()
        g.close()


def test_an_attached_process_follows_a_grow_without_a_request(broker):
    with grower_and_follower(broker, "rt/f", 2 * MiB) as (c, d, g, h):
        sent = count_requests(d)
        for size in (4 * MiB, 16 * MiB, 64 * MiB):
            g.grow(size)
            g.view()[size - 1] = size // MiB              # the grower writes the new tail
            r = h.sync()                                  # the notice arrives; the memfd it kept maps it
            assert r.grown and h.size == size and h.view()[size - 1] == size // MiB
        h.view()[0] = 7
        assert g.view()[0] == 7
        assert sent == {}                                 # not one request, on either socket
        deadline = time.monotonic() + 10                  # and every notice reached the fresh session
        while h._announced[:2] != (3, 64 * MiB) and time.monotonic() < deadline:
            d._channel.pump(0.1)
        assert h._announced[:2] == (3, 64 * MiB)
        # Its own grow after following: one round trip, and the chunks it mapped are not resent.
        assert h.grow(128 * MiB).size == 128 * MiB and sent == {"control:grow": 1}
        assert g.sync().size == 128 * MiB


def test_the_message_channel_grow_still_grows_and_tells_the_other_holders(broker):
    with grower_and_follower(broker, "rt/z", MiB) as (c, d, g, h):
        reply = c._channel.call("grow", name="rt/z", nbytes=4 * MiB)
        assert (reply["size"], reply["gen"], reply["chunks"]) == (4 * MiB, 1, [MiB, 3 * MiB])
        assert h.sync().size == 4 * MiB
        assert g.grow(4 * MiB).size == 4 * MiB                # maps what the other op grew


def test_a_grow_reply_sends_no_fd_for_chunks_the_client_has(broker):
    with ipcpool.connect(broker.socket_dir) as c:
        g = c.create_growable("rt/n", MiB)
        ch = c._channel
        reply, fds = ch.control_call({"op": "grow", "name": "rt/n", "nbytes": MiB, "first": 1})
        assert fds == [] and reply["batch"] == [] and reply["size"] == MiB
        reply, fds = ch.control_call({"op": "grow", "name": "rt/n", "nbytes": 2 * MiB, "first": 1})
        assert len(fds) == 1 and reply["batch"] == [MiB]       # the host's one memfd
        for fd in fds:
            os.close(fd)
        assert "grow" in protocol.GROWABLE_CONTROL
        # Never told (its own session grew it), yet sync maps it: the host maps its memfd as long
        # as the file is now, so a grow is seen even before (or without) its notice.
        assert g.sync().size == 2 * MiB
        assert g.grow(2 * MiB).grown is False
        g.close()


def test_a_grow_right_after_a_free_sent_without_waiting_counts_the_free(start_broker):
    # The free goes on the message channel, the grow on the control socket: the grow is sent only
    # once the broker has read the free, or it could be refused for room the free gives back.
    b = start_broker(config_text='[[pools]]\nname = "default"\nmax_size = "64M"\n')
    with ipcpool.connect(b.socket_dir, arena_bytes=0) as c:
        g = c.create_growable("rt/room", 32 * MiB)
        for _ in range(50):
            buf = c.allocate(32 * MiB)
            sent = count_requests(c)
            buf.free()                                    # one-way: no reply to wait for
            g.grow(g.size + MiB)                          # would pass 64 MiB were buf still held
            assert sent == {"free": 1, "ping": 1, "control:grow": 1}
            assert c._channel._last_sent == c._channel._last_answered
            g.close()
            c.delete_growable("rt/room")
            g = c.create_growable("rt/room", 32 * MiB)
        g.close()


def test_a_follower_maps_a_grow_whose_notice_has_not_reached_it(broker):
    # The grower's reply comes on its control socket, the notice on the follower's message
    # channel: the grower may tell the follower to use the new bytes before the notice arrives.
    # Here no notice ever arrives before a sync: sync must map the buffer as it is anyway.
    with grower_and_follower(broker, "rt/late", 2 * MiB) as (c, d, g, h):
        d._channel.on_grown = lambda note: None           # every notice is late: none is seen
        for size in (4 * MiB, 16 * MiB, 64 * MiB):
            g.grow(size)
            g.view()[size - 1] = size // MiB
            r = h.sync()
            assert r.grown and h.size == size and h.view()[size - 1] == size // MiB
        assert h._announced[0] == 0                        # it mapped all that without a notice


def test_sync_asks_the_broker_where_the_backend_cannot_see_a_grow_by_itself(broker):
    # CUDA's path, taken on the host: a mapping that cannot follow (each CUDA chunk is an FD of
    # its own) syncs with one grow_sync round trip once the buffer grew, whatever the notices said
    # (its word on the growth board changed), and with none while nothing grew.
    with grower_and_follower(broker, "rt/ask", 2 * MiB) as (c, d, g, h):
        h._mapping.follows = False
        d._channel.on_grown = lambda note: None
        sent = count_requests(d)
        g.grow(8 * MiB)
        g.view()[8 * MiB - 1] = 9
        r = h.sync()
        assert sent == {"control:grow_sync": 1}
        assert r.grown and h.size == 8 * MiB and h.view()[8 * MiB - 1] == 9
        assert h._announced[:2] == (1, 8 * MiB)            # learnt from the reply
        sent.clear()
        assert h.sync().grown is False and sent == {}      # nothing grew: no request
        assert h.view()[8 * MiB - 1] == 9 and sent == {}   # view() and CAI sync the same way
        # The reply carries the current size and the FDs of the chunks from ``first`` only.
        reply, fds = d._channel.control_call({"op": "grow_sync", "name": "rt/ask", "first": 2})
        assert (reply["size"], reply["gen"], reply["batch"], fds) == (8 * MiB, 1, [], [])
        reply, fds = d._channel.control_call({"op": "grow_sync", "name": "rt/ask", "first": 1})
        assert reply["batch"] == [6 * MiB] and len(fds) == 1
        os.close(fds[0])
        sent.clear()
        g.grow(12 * MiB)                                    # a grow after: exactly one request
        assert h.sync().grown and h.size == 12 * MiB and sent == {"control:grow_sync": 1}
        g.grow(8 * MiB)                                     # no more than the size: nothing grew
        assert h.sync().grown is False and sent == {"control:grow_sync": 1}


def test_a_grow_to_no_more_than_the_size_tells_nobody(broker):
    with grower_and_follower(broker, "rt/same", 4 * MiB) as (c, d, g, h):
        g.grow(2 * MiB)
        g.grow(4 * MiB)
        d.stats()                                           # anything sent before its reply is in
        d._channel.drain()
        assert h._announced[0] == 0 and g.generation == 0


def test_a_create_that_fails_between_its_request_and_its_reply_leaves_the_control_socket_in_step(broker):
    """Work a create does while the broker answers (reserving its mapping) may fail: the error is
    the caller's, and the reply is read anyway, so the next request gets its own reply."""
    with ipcpool.connect(broker.socket_dir) as c:
        def no_room(device, span=None):
            raise MemoryError("no address space left")

        c._backend.prepare_growable = no_room
        with pytest.raises(MemoryError, match="no address space left"):
            c.create_growable("rt/failed", MiB)
        del c._backend.prepare_growable
        g = c.create_growable("rt/next", 2 * MiB)          # answered with its own reply
        assert g.name == "rt/next" and g.size == 2 * MiB
        assert {x["name"] for x in c.list_growables()} == {"rt/failed", "rt/next"}   # the broker made both
        g.close()
