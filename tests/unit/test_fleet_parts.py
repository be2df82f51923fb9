"""The parts of a pull that need no NIXL: UCX's protocol tables read, peer messages checked,
CHECKPOINT@VERSION split, digests."""

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


def test_gpu_memory_over_tcp_is_named_as_such():
    gpu = TABLES.replace("into host memory from host", "into cuda memory from cuda").replace("cma/memory", "tcp/eth0 ")
    t = transport.parse(gpu)
    assert t.names == ("tcp",) and t.tcp_gpu
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


class RefusingAgent:
    """A NIXL agent that refuses to register the memory types given, as NIXL does GPU memory where
    UCX has no CUDA support."""

    def __init__(self, *refused: str):
        self.refused, self.registered = refused, []

    def register_memory(self, regions, memory):
        if memory in self.refused:
            raise RuntimeError("NIXL_ERR_BACKEND")
        self.registered.append((memory, regions))
        return len(self.registered)

    def deregister_memory(self, handle):
        self.registered[handle - 1] = None


def test_gpu_memory_nixl_refuses_is_staged_through_host_buffers_and_said_so():
    from types import SimpleNamespace

    from ipcpool.fleet import staging
    from ipcpool.fleet.pull import _staged

    agent = RefusingAgent("VRAM")
    shards = [SimpleNamespace(ptr=1 << 20, size=4096, device=1), SimpleNamespace(ptr=2 << 20, size=100, device=1)]
    r = staging.register(agent, shards, True, "m@1", fill=False)
    assert (r.memory, r.staged) == ("DRAM", "VRAM") and [buf.nbytes for buf in r.host] == [4096, 100]
    assert r.regions == [(buf.ctypes.data, buf.nbytes, 0) for buf in r.host]
    assert agent.registered == [("DRAM", [(*region, "") for region in r.regions])]
    r.close()
    assert agent.registered == [None] and r.host is None
    assert _staged("a", "VRAM", "VRAM") == "a's GPU memory and this node's GPU memory staged through host buffers"
    assert _staged("a", None, None) == "" and _staged("a", None, "DRAM") == "this node's host memory staged through " \
                                                                           "host buffers"


def test_gpu_memory_nixl_refuses_with_no_host_buffer_either_is_reported_with_the_usual_cause():
    from types import SimpleNamespace

    from ipcpool.errors import TransferFailed
    from ipcpool.fleet import staging

    shard = SimpleNamespace(ptr=1 << 20, size=4096, device=0)
    with pytest.raises(TransferFailed) as caught:
        staging.register(RefusingAgent("VRAM", "DRAM"), [shard], True, "m@1", fill=True)
    assert str(caught.value).startswith("cannot register the GPU memory of m@1 with NIXL (NIXL_ERR_BACKEND; "
                                        "UCX likely has no CUDA support"), caught.value
    assert str(caught.value).endswith(", nor a host buffer to stage it through (NIXL_ERR_BACKEND)"), caught.value
