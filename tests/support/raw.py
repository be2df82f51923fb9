"""Talking to a broker by hand, below the client library: a bare control socket, a session opened
by hand, and what a refused peer gets."""

import contextlib
import socket

import zmq

from ipcpool import fdpass, protocol


def control(broker) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect(str(broker.socket_dir / "broker.sock"))
    return s


def reply_then_eof(sock) -> dict:
    got = fdpass.recv(sock)
    assert got is not None, "expected an error reply before the disconnect"
    msg, fds = got
    assert fds == []
    assert fdpass.recv(sock) is None, "expected the broker to disconnect"
    return msg


@contextlib.contextmanager
def raw_session(broker):
    """A session opened by hand: (control socket, DEALER with the session token)."""
    s = control(broker)
    fdpass.send(s, {"op": "hello", "version": protocol.PROTOCOL_VERSION})
    hello, _ = fdpass.recv(s)
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.IDENTITY, hello["token"])
    d.setsockopt(zmq.RCVTIMEO, 5000)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(hello["endpoint"])
    try:
        yield s, d
    finally:
        d.close()
        ctx.term()
        s.close()
