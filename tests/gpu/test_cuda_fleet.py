"""Beyond one node with GPU memory: two CUDA brokers on one GPU, a checkpoint pulled through NIXL
(staged through plain GPU buffers on both sides by default, or through host buffers where NIXL
refuses those or the puller asks for them), read back byte for byte; a flipped byte is refused.
Skips without a GPU or without NIXL. The pull's line (transport, staging) is in every
assertion's message."""

from __future__ import annotations

import os

import pytest

import ipcpool
from ipcpool.fleet import wire
from tests.support.fleet import model, pool_used, settled_used

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


def read_back(fleet, tensors, said):
    """Every tensor of b's m on the GPU, its bytes' digest the source's."""
    with ipcpool.connect(fleet.b.socket_dir) as r, r.attach("m") as ck:
        assert ck.user["pulled_from"] == "a"
        for name, want in tensors.items():
            got = ck.tensors[name]
            assert got.is_cuda and wire.digest(got.cpu().numpy().tobytes()) == wire.digest(want.tobytes()), \
                (name, said)


def test_a_pull_between_two_cuda_brokers_goes_through_gpu_buffers_and_is_byte_identical(start_fleet, tmp_path):
    """The default on CUDA: each side copies its broker's pool memory to or from plain device
    buffers of its own, which NIXL registers as VRAM (UCX mis-reads the imported pool memory)."""
    fleet = start_fleet(backend="cuda")
    path, tensors = model(tmp_path, big=64 << 20)
    with ipcpool.connect(fleet.a.socket_dir) as c:
        c.load_checkpoint("m", path, progress=False)
    done = fleet.pull("a", "m")
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    assert "pulled a's m@1 as version 1: 4 tensor(s)" in done.stdout, said
    if "through a GPU buffer (" in fleet.server.log() or "NIXL refused" in done.stderr:
        pytest.skip(f"NIXL refused plain GPU memory here (UCX without CUDA support): {said}")
    assert done.stdout.rstrip().endswith("; a's GPU memory and this node's GPU memory staged through GPU buffers"), said
    assert "staging auto: gpu then host" in fleet.server.log()
    if "UCX_LOG_FILE" not in os.environ:   # (UCX's log is then ours: its protocol table is read)
        assert "(cuda memory to cuda memory)" in done.stdout, said
    if "over tcp" in done.stdout:   # GPU memory over TCP: the pull must say so
        assert "warning: GPU memory went over TCP" in done.stderr, said
    read_back(fleet, tensors, said)


@pytest.mark.parametrize("where", ["refused", "asked"])
def test_gpu_memory_staged_through_host_buffers_arrives_byte_identical(start_fleet, tmp_path, where):
    """The fallback where UCX cannot register GPU memory at all, forced on both sides by the test
    hook (GPU shards copied to host buffers at the serve-peer, and from them at the puller); or
    host buffers asked for by the puller alone, read from the serve-peer's GPU buffers."""
    refuse = {"IPCPOOL_TEST_NIXL_REFUSE": "shards,gpu"}
    fleet = start_fleet(backend="cuda", serve_env=refuse if where == "refused" else None)
    path, tensors = model(tmp_path, big=64 << 20)
    with ipcpool.connect(fleet.a.socket_dir) as c:
        c.load_checkpoint("m", path, progress=False)
    done = fleet.pull("a", "m", env=refuse if where == "refused" else {"IPCPOOL_NIXL_STAGING": "host"})
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    if where == "refused":
        staged = "a's GPU memory and this node's GPU memory staged through host buffers"
        assert done.stdout.rstrip().endswith(f"; {staged}"), said
        assert f"warning: {staged}: NIXL refused" in done.stderr, said
    else:
        assert done.stdout.rstrip().endswith("; a's GPU memory staged through GPU buffers and this node's GPU "
                                             "memory staged through host buffers"), said
        assert "warning: this node's GPU memory staged through host buffers: as [nixl] staging" in done.stderr, said
    read_back(fleet, tensors, said)


def test_a_flipped_byte_in_gpu_memory_is_refused(start_fleet, tmp_path):
    """The byte is flipped in the served version's memory: it travels through the GPU buffers."""
    fleet = start_fleet(backend="cuda", serve_env={"IPCPOOL_TEST_FLIP_BYTE": "big"})
    with ipcpool.connect(fleet.a.socket_dir) as c:
        c.load_checkpoint("m", model(tmp_path)[0], progress=False)
    base = pool_used(fleet.b.socket_dir)
    done = fleet.pull("a", "m")
    assert done.returncode == 2 and "tensor 'big' of m@1 pulled from a: its bytes differ" in done.stderr, done.stderr
    with ipcpool.connect(fleet.b.socket_dir) as c:
        assert c.list_checkpoints() == []
    assert settled_used(fleet.b.socket_dir, base) == base
