"""The parts of a pull that need no NIXL: UCX's protocol tables read, peer messages checked,
CHECKPOINT@VERSION split, digests, which kinds of staging are tried and how the pull words them."""

import pytest

from ipcpool.errors import InvalidRequest, ProtocolError
from ipcpool.fleet import transport, wire
from ipcpool.fleet.command import split_version

# What UCX 1.19 (nixl-cu13 1.5.1) wrote with UCX_PROTO_INFO=y for a pull on one host.
TABLES = """\
[1795596558.147693] [vm:725  :0]   | b#pull-725-1 self cfg#0                                  |
[1795596558.147693] [vm:725  :0]   | remote memory write by ucp_put* from host memory to host |
[1795596558.147693] [vm:725  :0]   +--------+-------------+-----------------------------------+
[1795596558.147693] [vm:725  :0]   | Range  | Description |              Config               |
[1795596558.147693] [vm:725  :0]   | 0..inf | zero-copy   | tcp/lo                            |
[1795595574.485756] [vm:21066:1]   | cli intra-node cfg#1                                             |
[1795595574.485756] [vm:21066:1]   | remote memory read by ucp_get*(multi) into host memory from host |
[1795595574.485756] [vm:21066:1]   +--------+-------------+-------------------------------------------+
[1795595574.485756] [vm:21066:1]   | Range  | Description |                  Config                   |
[1795595574.485756] [vm:21066:1]   +--------+-------------+-------------------------------------------+
[1795595574.485756] [vm:21066:1]   | 0..inf | zero-copy   | cma/memory                                |
[1795595574.485756] [vm:21066:1]   +--------+-------------+-------------------------------------------+
[1795595574.490719] [vm:21066:1]   | cli intra-node cfg#1                                   |
[1795595574.490719] [vm:21066:1]   | active message by ucp_am_send*(multi) from host memory |
[1795595574.490719] [vm:21066:1]   |     0..8184 | short              | tcp/lo              |
"""


def test_the_transport_is_the_one_ucx_chose_for_remote_reads():
    t = transport.parse(TABLES)
    assert t.names == ("cma",) and (t.source, t.into) == ("host", "host") and not t.tcp_gpu
    assert t.describe() == "cma (host memory to host memory)" and t.detail == "0..inf zero-copy cma/memory"
    assert transport.parse("nothing of UCX") is transport.UNKNOWN and transport.UNKNOWN.describe() == "unknown"


# What the same UCX wrote on an H100 for a pull between two processes' GPU buffers: UCX chose its
# TCP loopback for GPU memory (the silent fallback users of NIXL report).
GPU_TABLES = """\
[1795725694.840421] [vm:3433 :0]   +--------+--------------------+-----------------------------------------+
[1795725694.840421] [vm:3433 :0]   | b#pull-3433-1 intra-node cfg#2                                        |
[1795725694.840421] [vm:3433 :0]   | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[1] |
[1795725694.840421] [vm:3433 :0]   +--------+--------------------+-----------------------------------------+
[1795725694.840421] [vm:3433 :0]   | Range  |    Description     |                 Config                  |
[1795725694.840421] [vm:3433 :0]   +--------+--------------------+-----------------------------------------+
[1795725694.840421] [vm:3433 :0]   | 0..inf | software emulation | tcp/lo                                  |
[1795725694.840421] [vm:3433 :0]   +--------+--------------------+-----------------------------------------+
[1795725704.257972] [vm:3433 :0]   | floor-reader self cfg#0                                  |
[1795725704.257972] [vm:3433 :0]   | remote memory write by ucp_put* from host memory to host |
[1795725704.257972] [vm:3433 :0]   | 0..4294967295 | short       | cuda_copy/cuda             |
"""


def test_gpu_memory_over_tcp_is_named_as_such():
    t = transport.parse(GPU_TABLES)
    assert t.names == ("tcp",) and (t.source, t.into) == ("cuda", "cuda") and t.tcp_gpu
    assert t.describe() == "tcp (cuda memory to cuda memory)" and t.detail == "0..inf software emulation tcp/lo"
    lanes = TABLES.replace("cma/memory      ", "50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_1:1")
    assert transport.parse(lanes).names == ("rc_mlx5",)


def test_peer_messages_round_trip_and_junk_is_refused():
    msg = wire.decode(wire.encode("want", req="r1", name="m", version=None))
    assert msg == {"op": "want", "req": "r1", "name": "m", "version": None}
    assert wire.decode(b"someone else's notification") is None
    for junk, message in [(wire.TAG + b"\xc1", "not msgpack"), (wire.TAG + b"\x01", "a map with 'op' and 'req'"),
                          (wire.encode("want"), "a map with 'op' and 'req'")]:
        with pytest.raises(ProtocolError, match=message):
            wire.decode(junk)


def test_checkpoint_at_version_and_digests():
    assert split_version("llama") == ("llama", None) and split_version("a@b@7") == ("a@b", 7)
    for bad in ("m@", "@3", "m@x"):
        with pytest.raises(InvalidRequest, match="CHECKPOINT@VERSION"):
            split_version(bad)
    assert wire.digest(b"abc") != wire.digest(b"abd") and len(wire.digest(memoryview(b"x" * 10))) == 32


@pytest.mark.parametrize("offset, nbytes, piece", [(0, 1000, 64), (3, 997, 100), (10, 0, 7), (0, 1000, 1 << 20)])
def test_a_tensor_read_piece_by_piece_has_the_digest_of_its_bytes(offset, nbytes, piece):
    from types import SimpleNamespace

    from ipcpool.fleet.digests import digests, tensor_digest

    data = bytes(range(256)) * 4
    shard = SimpleNamespace(memory=SimpleNamespace(view=memoryview(data)))   # host memory, as a shard has it
    assert tensor_digest(shard, offset, nbytes, piece) == wire.digest(data[offset:offset + nbytes])
    entries = [SimpleNamespace(shard=0, offset=o, nbytes=n) for o, n in ((0, 10), (offset, nbytes), (5, 1))]
    assert digests([shard], entries) == [wire.digest(data[e.offset:e.offset + e.nbytes]) for e in entries]


@pytest.mark.parametrize("asked, on_gpu, tried", [
    ("auto", True, ["gpu", "host"]), ("auto", False, ["shards", "host"]),
    ("off", True, ["shards", "gpu", "host"]), ("off", False, ["shards", "host"]),
    ("gpu", True, ["gpu", "host"]), ("gpu", False, ["host"]), ("host", True, ["host"]), ("host", False, ["host"]),
])
def test_the_kinds_tried_go_from_the_one_asked_for_to_the_costlier_ones(asked, on_gpu, tried):
    """GPU memory is never registered as it is unless asked ("off"): UCX may take the broker's
    imported pool memory and then hang on it; GPU buffers only stand in for GPU memory."""
    from ipcpool.fleet import staging

    assert staging.attempts(asked, on_gpu) == tried


def test_the_staging_asked_for_is_the_environments_else_the_configs(monkeypatch):
    from ipcpool.config import Fleet, parse
    from ipcpool.errors import ConfigError
    from ipcpool.fleet import staging

    monkeypatch.delenv(staging.STAGING_ENV, raising=False)
    assert staging.setting(Fleet()) == "auto" and staging.setting(parse({"nixl": {"staging": "off"}}).fleet) == "off"
    monkeypatch.setenv(staging.STAGING_ENV, "host")
    assert staging.setting(Fleet(staging="gpu")) == "host"
    monkeypatch.setenv(staging.STAGING_ENV, "dram")
    with pytest.raises(ConfigError, match="IPCPOOL_NIXL_STAGING: one of auto, off, gpu, host, got 'dram'"):
        staging.setting(Fleet())
    with pytest.raises(ConfigError, match="nixl.staging: one of auto, off, gpu, host, got 'yes'"):
        parse({"nixl": {"staging": "yes"}})


def test_which_sides_were_staged_through_what_in_words():
    from ipcpool.fleet.pull import _staged

    gpu, host, none = ("VRAM", "gpu"), ("VRAM", "host"), (None, None)
    assert _staged("a", gpu, gpu) == "a's GPU memory and this node's GPU memory staged through GPU buffers"
    assert _staged("a", gpu, host) == "a's GPU memory staged through GPU buffers and this node's GPU memory " \
                                      "staged through host buffers"
    assert _staged("a", gpu, host, only="host") == "this node's GPU memory staged through host buffers"
    assert _staged("a", none, none) == "" and _staged("a", gpu, none, only="host") == ""
    assert _staged("a", ("DRAM", "host"), none) == "a's host memory staged through host buffers"


def test_a_pull_reads_each_region_as_one_descriptor_of_one_xfer_after_a_first_read_of_a_few_bytes():
    """As the floor reads: no pieces, one xfer (a descriptor may not cross two registrations,
    so one per region); UCX's set-up at a first read of WARM bytes of each. The stall hook cuts."""
    from ipcpool.errors import TransferFailed
    from ipcpool.fleet.pull import WARM, _reads

    local, remote = [(1000, 3 << 20, 0), (9000, 100, 0)], [(50, 3 << 20, 1), (7000, 100, 1)]
    first, reads = _reads(local, remote)
    assert first == ([(1000, WARM, 0), (9000, 100, 0)], [(50, WARM, 1), (7000, 100, 1)])
    assert reads == [(local, remote)]
    _, cut = _reads(local, remote, step=1 << 20)
    assert cut == [([(1000 + at, 1 << 20, 0)], [(50 + at, 1 << 20, 1)]) for at in (0, 1 << 20, 2 << 20)] + \
                  [([(9000, 100, 0)], [(7000, 100, 1)])]
    with pytest.raises(TransferFailed, match="a local shard of 100 bytes for a peer's of 101"):
        _reads(local, [remote[0], (7000, 101, 1)])
