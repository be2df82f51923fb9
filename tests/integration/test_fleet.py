"""Beyond one node, on the host backend: two brokers on one machine, a checkpoint pulled from
one into the other through NIXL (UCX) by `ipcpool pull`. Skipped where NIXL is not installed."""

import os
import signal
import subprocess
import sys
import time

import pytest

import ipcpool
from tests.support.cli import IPCPOOL
from tests.support.fleet import model, pool_used, settled_used


def test_a_pulled_checkpoint_is_byte_identical_for_a_reader_of_the_second_broker(start_fleet, tmp_path):
    fleet = start_fleet()
    path, tensors = model(tmp_path)
    with ipcpool.connect(fleet.a.socket_dir) as c:
        c.load_checkpoint("m", path, progress=False)
    done = fleet.pull("a", "m")
    assert done.returncode == 0, done.stderr
    assert "pulled a's m@1 as version 1: 4 tensor(s)" in done.stdout
    assert "over cma" in done.stdout or "over tcp" in done.stdout, done.stdout   # UCX's choice, named
    assert "unused environment variable" not in fleet.server.log()   # (the GPU-only UCX setting: not on the host)
    with ipcpool.connect(fleet.b.socket_dir) as r, r.attach("m", kind="numpy") as ck:
        assert ck.version == 1 and ck.user["pulled_from"] == "a" and ck.user["peer_version"] == 1
        assert sorted(ck.tensors) == sorted(tensors)
        for name, want in tensors.items():
            got = ck.tensors[name]
            assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes(), name


def test_a_named_version_in_python_and_over_tcp(start_fleet, tmp_path):
    """``Client.pull`` of version 1 (held by a reader of a) once version 2 is current; UCX held to
    TCP says so."""
    fleet = start_fleet()
    held = ipcpool.connect(fleet.a.socket_dir)
    held.load_checkpoint("m", model(tmp_path, 1)[0], progress=False)
    v1 = held.attach("m", kind="numpy")
    held.load_checkpoint("m", model(tmp_path, 2)[0], progress=False)
    code = ("import ipcpool, sys\n"
            "from ipcpool.fleet import pull\n"
            "with ipcpool.connect(sys.argv[1]) as c:\n"
            "    r = pull(c, 'a', 'm', version=1, config=sys.argv[2], local_name='old')\n"
            "    print(r.version, r.peer_version, r.transport.names, r.nbytes, r.bytes_per_s > 0, r.staging == ('', ''),"
            " r.warning)\n")
    out = subprocess.run([sys.executable, "-c", code, str(fleet.b.socket_dir), str(fleet.b_config)],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "UCX_TLS": "tcp,self"})
    v1.release()
    held.close()
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:3] == ["1", "1", "('tcp',)"]
    assert out.stdout.split()[-2:] == ["True", "None"]   # host memory registered as it is, over TCP: no warning
    _, want = model(tmp_path, 1)
    with ipcpool.connect(fleet.b.socket_dir) as r, r.attach("old", kind="numpy") as ck:
        assert ck.tensors["big"].tobytes() == want["big"].tobytes()


@pytest.mark.parametrize("staged", [False, True], ids=["registered", "staged"])
def test_a_corrupted_byte_is_caught_by_its_digest_and_nothing_is_published(start_fleet, tmp_path, staged):
    """Also where both sides' memory goes through host buffers: the flipped byte travels in the
    serve-peer's staged copy and is caught in the puller's shards."""
    refuse = {"IPCPOOL_TEST_NIXL_REFUSE": "shards"} if staged else {}
    fleet = start_fleet(serve_env={"IPCPOOL_TEST_FLIP_BYTE": "a.bias", **refuse})
    with ipcpool.connect(fleet.a.socket_dir) as c:
        c.load_checkpoint("m", model(tmp_path)[0], progress=False)
    base = pool_used(fleet.b.socket_dir)
    done = fleet.pull("a", "m", env=refuse)
    assert done.returncode == 2
    assert "tensor 'a.bias' of m@1 pulled from a: its bytes differ from the peer's digest" in done.stderr
    assert "nothing was published" in done.stderr
    with ipcpool.connect(fleet.b.socket_dir) as c:
        assert c.list_checkpoints() == []
    assert settled_used(fleet.b.socket_dir, base) == base


def test_killing_the_puller_mid_transfer_leaves_no_partial_checkpoint(start_fleet, tmp_path):
    fleet = start_fleet()
    path, tensors = model(tmp_path, big=8 << 20)
    with ipcpool.connect(fleet.a.socket_dir) as c:
        c.load_checkpoint("m", path, progress=False)
    base = pool_used(fleet.b.socket_dir)
    # A slow link (1 MiB at a time, 0.3 s apart): the puller is killed with the version half filled.
    puller = subprocess.Popen([*IPCPOOL, *fleet.pull_args("a", "m")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "IPCPOOL_TEST_PULL_STALL": "0.3"})
    try:
        with ipcpool.connect(fleet.b.socket_dir) as c:
            deadline = time.monotonic() + 60
            while not [v for ck in c.list_checkpoints() for v in ck["versions"] if v["state"] == "writing"]:
                assert puller.poll() is None and time.monotonic() < deadline, puller.communicate()
                time.sleep(0.02)
            time.sleep(0.7)   # a few pieces in
            puller.send_signal(signal.SIGKILL)
            puller.wait(15)
            deadline = time.monotonic() + 30
            while c.list_checkpoints() or c.stats()["pools"]["default"]["used"] != base:
                assert time.monotonic() < deadline, (c.list_checkpoints(), c.stats()["pools"]["default"])
                time.sleep(0.05)
            with pytest.raises(ipcpool.ObjectNotFound):
                c.attach("m", kind="numpy")
    finally:
        if puller.poll() is None:
            puller.kill()
        puller.communicate()
    done = fleet.pull("a", "m")                        # the serve-peer serves on
    assert done.returncode == 0, done.stderr
    with ipcpool.connect(fleet.b.socket_dir) as r, r.attach("m", kind="numpy") as ck:
        assert ck.tensors["big"].tobytes() == tensors["big"].tobytes()


def test_refusals_say_what_to_do(start_fleet, tmp_path):
    fleet = start_fleet(serve=("served/",))
    with ipcpool.connect(fleet.a.socket_dir) as c:
        c.load_checkpoint("m", model(tmp_path)[0], progress=False)
    cases = [
        (("nobody", "m"), "no peer named 'nobody' in the configuration (peers: a)"),
        (("a", "m@x"), "'m@x': expected CHECKPOINT or CHECKPOINT@VERSION"),
        (("a", "m"), "checkpoint 'm' is not served to peers (the [nixl] serve prefixes of 'a': ['served/'])"),
        (("a", "served/none"), "no checkpoint named 'served/none'"),
    ]
    for args, message in cases:
        done = fleet.pull(*args)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)
    fleet.server.stop()
    done = fleet.pull("a", "m", "--timeout", "2")
    assert done.returncode == 2 and "no NIXL metadata came back (is `ipcpool serve-peer` running there" in done.stderr
    with ipcpool.connect(fleet.b.socket_dir) as c:
        assert c.list_checkpoints() == []


def test_a_request_that_fails_at_the_serve_peer_is_answered_at_once_and_it_serves_on(start_fleet, tmp_path):
    """NIXL refusing the served memory (as it does GPU memory where UCX lacks CUDA support) fails
    that pull with the reason, well before the puller's timeout; the serve-peer answers the next."""
    fleet = start_fleet(serve_env={"IPCPOOL_TEST_NIXL_REFUSE": "all"})
    with ipcpool.connect(fleet.a.socket_dir) as c:
        c.load_checkpoint("m", model(tmp_path)[0], progress=False)
    t0 = time.monotonic()
    done = fleet.pull("a", "m", "--timeout", "60")
    assert done.returncode == 2 and time.monotonic() - t0 < 30, done.stderr
    assert "ipcpool pull: peer a (127.0.0.1:" in done.stderr, done.stderr
    assert "cannot register the host memory of m@1 with NIXL (NIXL_ERR_BACKEND), nor a host buffer to stage " \
           "it through (NIXL_ERR_BACKEND)" in done.stderr, done.stderr
    assert fleet.server.proc.poll() is None and "cannot register the host memory of m@1" in fleet.server.log()
    done = fleet.pull("a", "other", "--timeout", "60")
    assert done.returncode == 2 and "no checkpoint named 'other'" in done.stderr, done.stderr
    with ipcpool.connect(fleet.b.socket_dir) as c:
        assert c.list_checkpoints() == []


def test_the_puller_refused_its_own_memory_fails_clearly_and_leaves_nothing(start_fleet, tmp_path):
    fleet = start_fleet()
    with ipcpool.connect(fleet.a.socket_dir) as c:
        c.load_checkpoint("m", model(tmp_path)[0], progress=False)
    base = pool_used(fleet.b.socket_dir)
    done = fleet.pull("a", "m", env={"IPCPOOL_TEST_NIXL_REFUSE": "all"})
    assert done.returncode == 2, done.stderr
    assert "ipcpool pull: cannot register the host memory of the new version of m here with NIXL " \
           "(NIXL_ERR_BACKEND), nor a host buffer to stage it through (NIXL_ERR_BACKEND); nothing was published" \
           in done.stderr, done.stderr
    with ipcpool.connect(fleet.b.socket_dir) as c:
        assert c.list_checkpoints() == []
    assert settled_used(fleet.b.socket_dir, base) == base
    assert fleet.pull("a", "m").returncode == 0        # the serve-peer was told "done" and serves on


@pytest.mark.parametrize("where", ["serve-peer", "puller", "both"])
def test_memory_nixl_refuses_goes_through_host_buffers_and_arrives_byte_identical(start_fleet, tmp_path, where):
    """Where NIXL cannot register a side's broker memory (GPU memory, UCX without CUDA support),
    that side stages it through host buffers; the pull says so and its bytes are the peer's."""
    refuse = {"IPCPOOL_TEST_NIXL_REFUSE": "shards"}
    fleet = start_fleet(serve_env=refuse if where != "puller" else None)
    path, tensors = model(tmp_path)
    with ipcpool.connect(fleet.a.socket_dir) as c:
        c.load_checkpoint("m", path, progress=False)
    done = fleet.pull("a", "m", env=refuse if where != "serve-peer" else None)
    assert done.returncode == 0, done.stderr
    staged = {"serve-peer": "a's host memory", "puller": "this node's host memory",
              "both": "a's host memory and this node's host memory"}[where] + " staged through host buffers"
    assert done.stdout.rstrip().endswith(f"; {staged}"), done.stdout
    assert f"ipcpool pull: warning: {staged}: NIXL refused to register that memory" in done.stderr, done.stderr
    if where != "puller":
        assert "cannot register the host memory of m@1 with NIXL (NIXL_ERR_BACKEND): staged through host buffers" \
               in fleet.server.log()
    with ipcpool.connect(fleet.b.socket_dir) as r, r.attach("m", kind="numpy") as ck:
        assert ck.version == 1 and sorted(ck.tensors) == sorted(tensors)
        for name, want in tensors.items():
            got = ck.tensors[name]
            assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes(), name


def test_staging_asked_for_is_used_and_said_though_nixl_refused_nothing(start_fleet, tmp_path):
    """Host buffers asked for by the serve-peer's environment and by the puller's broker.toml:
    both sides stage through them, and the pull names them and why (not a refusal)."""
    fleet = start_fleet(serve_env={"IPCPOOL_NIXL_STAGING": "host"})
    fleet.b_config.write_text(fleet.b_config.read_text().replace("[nixl]\n", '[nixl]\nstaging = "host"\n'))
    path, tensors = model(tmp_path)
    with ipcpool.connect(fleet.a.socket_dir) as c:
        c.load_checkpoint("m", path, progress=False)
    done = fleet.pull("a", "m")
    assert done.returncode == 0, done.stderr
    staged = "a's host memory and this node's host memory staged through host buffers"
    assert done.stdout.rstrip().endswith(f"; {staged}"), done.stdout
    assert f"warning: {staged}: as [nixl] staging (or IPCPOOL_NIXL_STAGING) asks, so every byte" in done.stderr
    assert "refused" not in done.stderr and "(DRAM memory, staging host: host)" in fleet.server.log()
    with ipcpool.connect(fleet.b.socket_dir) as r, r.attach("m", kind="numpy") as ck:
        for name, want in tensors.items():
            assert ck.tensors[name].tobytes() == want.tobytes(), name
