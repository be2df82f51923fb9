"""Beyond one node with GPU memory: two CUDA brokers on one GPU, a checkpoint pulled through NIXL
(VRAM registered on both sides, or staged through host buffers where UCX cannot register it),
read back byte for byte; a flipped byte is refused. Skips without a GPU or without NIXL. The
transport UCX chose is in every assertion's message."""

from __future__ import annotations

import pytest

import ipcpool
from tests.support.fleet import model, pool_used, settled_used

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


def test_a_pull_between_two_cuda_brokers_is_byte_identical(start_fleet, tmp_path):
    fleet = start_fleet(backend="cuda")
    path, tensors = model(tmp_path, big=64 << 20)
    with ipcpool.connect(fleet.a.socket_dir) as c:
        c.load_checkpoint("m", path, progress=False)
    done = fleet.pull("a", "m")
    assert done.returncode == 0, done.stderr
    assert "pulled a's m@1 as version 1: 4 tensor(s)" in done.stdout, done.stdout
    if "staged through host buffers" in done.stdout:   # NIXL refused GPU memory (UCX without CUDA support)
        assert "GPU memory staged through host buffers: NIXL refused" in done.stderr, done.stderr
    else:
        assert "(cuda memory to cuda memory)" in done.stdout, done.stdout
    if "over tcp" in done.stdout and "cuda memory" in done.stdout:   # GPU memory over TCP: the pull must say so
        assert "warning: GPU memory went over TCP" in done.stderr, done.stderr
    with ipcpool.connect(fleet.b.socket_dir) as r, r.attach("m") as ck:
        assert ck.user["pulled_from"] == "a"
        for name, want in tensors.items():
            got = ck.tensors[name]
            assert got.is_cuda and got.cpu().numpy().tobytes() == want.tobytes(), (name, done.stdout)


def test_gpu_memory_staged_through_host_buffers_arrives_byte_identical(start_fleet, tmp_path):
    """The fallback where UCX cannot register GPU memory, forced on both sides by the test hook:
    GPU shards copied to host buffers at the serve-peer, and from them at the puller."""
    refuse = {"IPCPOOL_TEST_NIXL_REFUSE": "shards"}
    fleet = start_fleet(backend="cuda", serve_env=refuse)
    path, tensors = model(tmp_path, big=64 << 20)
    with ipcpool.connect(fleet.a.socket_dir) as c:
        c.load_checkpoint("m", path, progress=False)
    done = fleet.pull("a", "m", env=refuse)
    assert done.returncode == 0, done.stderr
    assert "; a's GPU memory and this node's GPU memory staged through host buffers" in done.stdout, done.stdout
    with ipcpool.connect(fleet.b.socket_dir) as r, r.attach("m") as ck:
        for name, want in tensors.items():
            got = ck.tensors[name]
            assert got.is_cuda and got.cpu().numpy().tobytes() == want.tobytes(), (name, done.stdout)


def test_a_flipped_byte_in_gpu_memory_is_refused(start_fleet, tmp_path):
    fleet = start_fleet(backend="cuda", serve_env={"IPCPOOL_TEST_FLIP_BYTE": "big"})
    with ipcpool.connect(fleet.a.socket_dir) as c:
        c.load_checkpoint("m", model(tmp_path)[0], progress=False)
    base = pool_used(fleet.b.socket_dir)
    done = fleet.pull("a", "m")
    assert done.returncode == 2 and "tensor 'big' of m@1 pulled from a: its bytes differ" in done.stderr, done.stderr
    with ipcpool.connect(fleet.b.socket_dir) as c:
        assert c.list_checkpoints() == []
    assert settled_used(fleet.b.socket_dir, base) == base
