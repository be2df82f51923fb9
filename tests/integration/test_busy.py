"""A busy broker (issue 12, item 5): with its listen backlog full, connect() waits for it within
its timeout instead of reporting it gone."""

import os
import signal
import socket
import threading
import time

import pytest

import ipcpool


def fill_backlog(path) -> list[socket.socket]:
    """Connections the (stopped) broker has not accepted, until the kernel says EAGAIN."""
    socks = []
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.setblocking(False)
        try:
            s.connect(str(path))
        except BlockingIOError:
            s.close()
            return socks
        socks.append(s)
        assert len(socks) < 100_000


def test_connect_waits_while_the_listen_backlog_is_full(broker):
    os.kill(broker.pid, signal.SIGSTOP)
    fillers = []
    try:
        fillers = fill_backlog(broker.socket_dir / "broker.sock")
        assert len(fillers) >= 1
        t0 = time.monotonic()
        with pytest.raises(ipcpool.BrokerGone, match="listen backlog stayed full"):
            ipcpool.connect(broker.socket_dir, timeout=0.3)
        assert time.monotonic() - t0 >= 0.25          # it tried for its whole timeout
        wake = threading.Timer(0.5, os.kill, (broker.pid, signal.SIGCONT))
        wake.start()
        t0 = time.monotonic()
        with ipcpool.connect(broker.socket_dir, timeout=10) as c:
            assert c.stats()["pid"] == broker.pid
        assert 0.4 < time.monotonic() - t0 < 10
        wake.join()
    finally:
        os.kill(broker.pid, signal.SIGCONT)
        for s in fillers:
            s.close()
