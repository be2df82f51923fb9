"""A session's control socket and its request ring, read in the order that keeps its frames in order
(``ControlChannel.on_message``): a real socket pair and a real ring; the client's moves are put
where the broker's reads leave the worst gap."""

from __future__ import annotations

import mmap
import socket

from ipcpool import frames
from ipcpool.broker.control import ControlChannel
from ipcpool.broker.session import Session
from ipcpool.fdpass import PeerCred
from ipcpool.shm import requests


def test_a_seal_on_the_socket_never_overtakes_its_create_put_in_the_ring_meanwhile():
    """A client puts its create in the ring and, the ring full say, sends the seal on its socket.
    Where the broker looked at the ring just before the client's put and read the socket just after
    the send, the seal came first and was refused ("not an object this session is writing"): the
    ring must be read after the socket, so that all put before a socket message is taken before it."""
    mapping = mmap.mmap(-1, requests.AT + requests.LENGTH)
    ring, taken = requests.RingWriter(mapping), requests.RingReader(mapping)
    broker_end, client_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    broker_end.setblocking(False)
    create = frames.create(7, b"default", b"obj", b"", 1, 0, 4096, None, 0, b"")
    seal = frames.seal(8, b"obj", b"")
    handled: list[bytes] = []
    client_moves = [lambda: (ring.put(create), client_end.send(seal))]

    def take_ring(session: Session) -> None:
        handled.extend(taken.take())
        if client_moves:   # the client's put and send come right after the broker's look
            client_moves.pop()()

    control = ControlChannel(listener=None, config=None, sessions=None, guard=None, tables=None, handlers=None,
                             backend_name="host", endpoint="", watch=None, unwatch=None, access=None,
                             on_frame=lambda session, data: handled.append(data), take_ring=take_ring)
    session = Session(1, b"t", PeerCred(1, 0, 0), broker_end, -1, None)
    try:
        for _ in range(3):   # turns of the broker's loop
            control.on_message(session)
        assert [frames.request_id(f) for f in handled] == [7, 8]
        assert session.framed
    finally:
        broker_end.close()
        client_end.close()
