"""Durable memory on the host backend: a harness plays systemd's part (the notify socket with its
FD store, then LISTEN_FDS for the next broker) across a kill -9 of the broker."""

import array
import os
import signal
import socket
import subprocess
import threading

import numpy as np

import ipcpool
from tests.conftest import BrokerProc


class FdStore:
    """What systemd does with FDSTORE=1 / FDSTOREREMOVE=1 messages, reduced to a dict."""

    def __init__(self, path):
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.05)
        self.fds: dict[str, int] = {}
        self.ready = threading.Event()
        self._stop = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, daemon=True)   # systemd reads at once
        self._thread.start()

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.fds)

    def _serve(self):
        while not self._stop:
            try:
                data, anc, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(16 * 4))
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self._take(data, anc)

    def _take(self, data, anc):
        fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
        fds = []
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", payload[: len(payload) - len(payload) % 4]))
        if fields.get("FDSTORE") == "1" and fds:
            name = fields["FDNAME"]
            if name in self.fds:            # systemd ignores a second copy of a stored file
                os.close(fds[0])
            else:
                self.fds[name] = fds[0]
        elif fields.get("FDSTOREREMOVE") == "1":
            fd = self.fds.pop(fields["FDNAME"], None)
            if fd is not None:
                os.close(fd)
        else:
            for fd in fds:
                os.close(fd)
        if fields.get("READY") == "1":
            self.ready.set()


    def close(self):
        self._stop = True
        self._thread.join(5)
        for fd in self.fds.values():
            os.close(fd)
        self.sock.close()


def launch_with_fds(store: FdStore):
    """A launcher that starts a broker as systemd would after a crash: the stored FDs as 3, 4, ...
    and LISTEN_FDS, LISTEN_FDNAMES, LISTEN_PID (the pid known only once forked: set by a shell
    that then execs the broker in its place)."""
    stored = store.snapshot()
    names = list(stored)
    fds = [stored[n] for n in names]

    def place_fds():   # in the child, before exec: move them to 3.. (via high numbers, no clash)
        high = [os.dup2(os.dup(fd), 200 + i) for i, fd in enumerate(fds)]
        for i, h in enumerate(high):
            os.dup2(h, 3 + i)

    def launch(args, env, **kw):
        env = {**env, "LISTEN_FDS": str(len(fds)), "LISTEN_FDNAMES": ":".join(names)}
        wrapped = ["/bin/sh", "-c", 'LISTEN_PID=$$; export LISTEN_PID; exec "$0" "$@"', *args]
        return subprocess.Popen(wrapped, env=env, preexec_fn=place_fds,
                                pass_fds=tuple(range(3, 3 + len(fds))), **kw)

    return launch


def pattern(seed, n):
    return (np.arange(n, dtype=np.uint64) * 2654435761 + seed).astype(np.uint8)


def test_sealed_objects_survive_a_broker_crash(tmp_path):
    store = FdStore(tmp_path / "notify")
    sd = tmp_path / "sock"
    config = '[[pools]]\nname = "default"\nmax_size = "256M"\n'
    a = BrokerProc(sd, "host", config, tmp_path / "a.log", env={"NOTIFY_SOCKET": store.path})
    b = None
    try:
        a.wait_ready()
        with ipcpool.connect(sd) as c:
            c.put_tensor("keep/a", pattern(1, 3 << 20).reshape(3, -1), user={"v": 1})
            c.put_tensor("keep/b", pattern(2, 5000))
            c.create("lost/unsealed", 1 << 20)                      # a session's: not kept
            c.allocate(1 << 20)                                      # likewise
            c.put_tensor("gone/deleted", pattern(3, 100))
            c.delete("gone/deleted")
            g = c.create_growable("keep/grow", 1 << 20)
            g.grow(3 << 20)
            np.frombuffer(g.view(), np.uint8)[:] = pattern(5, 3 << 20)
            c.create_growable("gone/grow", 1 << 20).close()
            c.delete_growable("gone/grow")                          # released: its FD leaves the store
        assert store.ready.wait(10)
        assert set(store.snapshot()) == {"pool-default", "meta", "grow-1-0"}
        a.proc.send_signal(signal.SIGKILL)                           # a crash: no clean-up at all
        a.proc.wait(10)
        a.stop()

        b = BrokerProc(sd, "host", config, tmp_path / "b.log", env={"NOTIFY_SOCKET": store.path},
                       launch=launch_with_fds(store))
        b.wait_ready()
        assert "restored 2 sealed object(s) and 1 growable buffer(s) from the FD store" in b.log()
        with ipcpool.connect(sd) as c:
            listed = {o["name"]: o for o in c.list()}
            assert set(listed) == {"keep/a", "keep/b"}
            assert listed["keep/a"]["meta"] == {"dtype": "uint8", "shape": [3, 1 << 20], "user": {"v": 1}}
            assert np.array_equal(c.get_array("keep/a").ravel(), pattern(1, 3 << 20))
            assert np.array_equal(c.get_array("keep/b"), pattern(2, 5000))
            used = c.stats()["pools"]["default"]["used"]
            assert used == (3 << 20) + 5120                          # the two objects, 256-aligned
            c.put_tensor("new/c", pattern(4, 1 << 20))               # new memory avoids the old
            assert np.array_equal(c.get_array("keep/a").ravel(), pattern(1, 3 << 20))
            c.release_all("keep/a")
            c.release_all("keep/b")
            with c.attach_growable("keep/grow") as g:
                assert g.size == 3 << 20
                assert np.array_equal(np.frombuffer(g.view(), np.uint8), pattern(5, 3 << 20))
                g.grow(4 << 20)                                      # and it still grows
                assert np.array_equal(np.frombuffer(g.view(), np.uint8)[: 3 << 20], pattern(5, 3 << 20))
            c.delete("keep/b")
        assert b.stop() == 0
    finally:
        for proc in (a, b):
            if proc is not None:
                proc.stop()
        store.close()


def test_a_broker_outside_systemd_stores_nothing(broker):
    with ipcpool.connect(broker.socket_dir) as c:
        c.put_tensor("x", np.zeros(10))
    assert "FD store" not in broker.log()
