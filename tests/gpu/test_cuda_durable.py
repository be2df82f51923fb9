"""Durable memory on CUDA: sealed objects (slab ranges, whole pool allocations, VMM chunks) and a
growable buffer survive two kill -9s of the broker, with a harness in systemd's part."""

from __future__ import annotations

import signal

import pytest

import ipcpool
from tests.support.broker import BrokerProc
from tests.support.procs import run_together
from tests.support.fdstore import FdStore, launch_with_fds

pytestmark = pytest.mark.gpu

MiB = 1 << 20
BIG = (4 << 30) + 2 * MiB          # above the pool import limit: VMM chunks
OBJECTS = {"keep/small": 4096, "keep/mid": 256 * MiB}   # a slab range; a whole pool allocation


def big_ok(big) -> bool:
    """0x21 everywhere but the last 7 bytes, 3 there; checked a GiB at a time (a reduction over
    billions of elements may take int64 scratch)."""
    return all(bool(x.eq(0x21).all()) for x in big[:-7].split(1 << 30)) and big[-7:].tolist() == [3] * 7


def _write(sock, out):
    import torch

    from tests.support.kernels import pattern

    with ipcpool.connect(sock) as c:
        for seed, (name, n) in enumerate(OBJECTS.items()):
            c.put_tensor(name, pattern(torch, n, seed))
        big = torch.full((BIG,), 0x21, dtype=torch.uint8, device="cuda")
        big[-7:] = 3
        c.put_tensor("keep/big", big)
        c.put_tensor("gone/x", pattern(torch, 4096, 9))
        c.delete("gone/x")
        g = c.create_growable("keep/grow", 64 * MiB)
        g.grow(192 * MiB)
        torch.as_tensor(g, device="cuda").copy_(pattern(torch, 192 * MiB, 7))
        torch.cuda.synchronize()
        g.close()
        out.put("written")


def _read(sock, extra, out):
    import torch

    from tests.support.kernels import pattern

    ok = {}
    with ipcpool.connect(sock) as c:
        for seed, (name, n) in enumerate(OBJECTS.items()):
            ok[name] = bool(torch.equal(c.get_tensor(name), pattern(torch, n, seed)))
            c.release_all(name)
        big = c.get_tensor("keep/big")
        ok["keep/big"] = big.numel() == BIG and big_ok(big)
        del big
        c.release_all("keep/big")
        with c.attach_growable("keep/grow") as g:
            t = torch.as_tensor(g, device="cuda")
            ok["keep/grow"] = g.size == 192 * MiB and bool(torch.equal(t, pattern(torch, 192 * MiB, 7)))
            g.grow(256 * MiB)                                    # and it still grows
            ok["grown"] = bool(torch.equal(torch.as_tensor(g, device="cuda")[: 192 * MiB], pattern(torch, 192 * MiB, 7)))
        if extra == "put":
            c.put_tensor("new/a", pattern(torch, 8 * MiB, 11))    # new memory: the fresh pool
        else:
            ok["new/a"] = bool(torch.equal(c.get_tensor("new/a"), pattern(torch, 8 * MiB, 11)))
            c.release_all("new/a")
        torch.cuda.synchronize()
        out.put(ok)


def _crash_and_restart(store, sd, config, tmp_path, old: BrokerProc, tag: str) -> BrokerProc:
    old.proc.send_signal(signal.SIGKILL)                          # a crash: no clean-up at all
    old.proc.wait(10)
    old.stop()
    b = BrokerProc(sd, "cuda", config, tmp_path / f"{tag}.log", env={"NOTIFY_SOCKET": store.path},
                   launch=launch_with_fds(store))
    return b.wait_ready(60)


@pytest.mark.kills_clients
def test_objects_and_growables_survive_two_broker_crashes(tmp_path):
    store = FdStore(tmp_path / "notify")
    sd = tmp_path / "sock"
    config = '[[pools]]\nname = "default"\n'
    a = BrokerProc(sd, "cuda", config, tmp_path / "a.log", env={"NOTIFY_SOCKET": store.path})
    brokers = [a]
    try:
        a.wait_ready(60)
        assert run_together([(_write, (sd,))], timeout=300) == ["written"]
        assert store.ready.wait(10)
        names = store.names_when(lambda names: {"pool-default", "meta", "grow-1-0"} <= names)
        assert {"pool-default", "meta", "grow-1-0"} <= names
        assert any(n.startswith("vmm-") for n in names) and not any("gone" in n for n in names)

        b = _crash_and_restart(store, sd, config, tmp_path, a, "b")
        brokers.append(b)
        assert "restored 3 sealed object(s) and 1 growable buffer(s)" in b.log()
        assert "pool default adopted from the FD store as default~1 (read-only)" in b.log()
        (ok,) = run_together([(_read, (sd, "put"))], timeout=300)
        assert ok == dict.fromkeys(["keep/small", "keep/mid", "keep/big", "keep/grow", "grown"], True)
        with ipcpool.connect(sd) as c:
            assert {"default", "default~1"} <= set(c.stats()["pools"])
            with pytest.raises(ipcpool.InvalidRequest, match="cannot allocate"):
                c.allocate(MiB, pool="default~1")
            c.delete("keep/small")
            c.delete("keep/mid")                                  # the old generation's last objects
            assert "default~1" not in c.stats()["pools"]
        assert "pool-default~1" not in store.names_when(lambda names: "pool-default~1" not in names)

        c_ = _crash_and_restart(store, sd, config, tmp_path, b, "c")
        brokers.append(c_)
        assert "restored 2 sealed object(s) and 1 growable buffer(s)" in c_.log()
        (ok,) = run_together([(_read_second, (sd,))], timeout=300)
        assert ok == {"keep/big": True, "new/a": True, "keep/grow": True}
    finally:
        for br in brokers:
            if br.proc.poll() is None:
                br.stop()
        store.close()


def _read_second(sock, out):
    import torch

    from tests.support.kernels import pattern

    with ipcpool.connect(sock) as c:
        big = c.get_tensor("keep/big")
        ok = {"keep/big": big_ok(big)}
        del big
        c.release_all("keep/big")
        ok["new/a"] = bool(torch.equal(c.get_tensor("new/a"), pattern(torch, 8 * MiB, 11)))
        c.release_all("new/a")
        with c.attach_growable("keep/grow") as g:
            ok["keep/grow"] = g.size == 256 * MiB and bool(
                torch.equal(torch.as_tensor(g, device="cuda")[: 192 * MiB], pattern(torch, 192 * MiB, 7)))
        out.put(ok)
