"""Durable memory on the host backend: a harness plays systemd's part (the notify socket with its
FD store, then LISTEN_FDS for the next broker) across a kill -9 of the broker."""

import signal

import numpy as np

import ipcpool
from tests.support.broker import BrokerProc
from tests.support.fdstore import FdStore, launch_with_fds


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
        want = {"pool-default", "meta", "grow-1-0"}
        assert store.names_when(lambda names: names == want) == want
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
