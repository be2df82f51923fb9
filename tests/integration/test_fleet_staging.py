"""Staging (``ipcpool.fleet.staging``) with real NIXL agents on host memory: a version's shards
registered as they are or staged through host buffers, in the order asked for and as NIXL
refuses (the test hook), and the bytes read by another agent through whichever was registered.
GPU buffers need a GPU: tests/gpu/test_cuda_fleet.py. Skipped where NIXL is not installed."""

import itertools
import time
from types import SimpleNamespace

import numpy as np
import pytest

from ipcpool.backend.host import HostClientBackend
from ipcpool.errors import TransferFailed
from ipcpool.fleet import nixl, staging

pytestmark = pytest.mark.skipif(not nixl.available(), reason="NIXL is not installed")
SIZES = (4096, 100, 1 << 20)
_names = itertools.count()


def shards(fill: bool) -> list[SimpleNamespace]:
    """Host memory standing as a version's shards (the host backend's are addresses in a mapping)."""
    rng = np.random.default_rng(7)
    made = []
    for size in SIZES:
        a = rng.integers(0, 256, size, dtype=np.uint8) if fill else np.zeros(size, np.uint8)
        made.append(SimpleNamespace(ptr=a.ctypes.data, size=size, device=None, array=a))
    return made


@pytest.fixture
def agents():
    """A serving agent and a reading one in this process, the reader knowing the server."""
    server, reader = (nixl.agent(f"staging-{next(_names)}", 0, False) for _ in range(2))
    return server, reader


def read_all(reader, server, served: staging.Registered, into: staging.Registered) -> None:
    """One NIXL READ of every region the server registered into the reader's."""
    name = reader.add_remote_agent(server.get_agent_metadata())
    handle = reader.initialize_xfer("READ", reader.get_xfer_descs(into.regions, into.memory),
                                    reader.get_xfer_descs(served.regions, served.memory), name)
    state, deadline = reader.transfer(handle), time.monotonic() + 30
    while state == "PROC" and time.monotonic() < deadline:
        state = reader.check_xfer_state(handle)
    reader.release_xfer_handle(handle)
    reader.remove_remote_agent(name)
    assert state == "DONE"


@pytest.mark.parametrize("asked, refuse, through", [
    ("auto", "", None), ("off", "", None),          # host memory is registered as it is
    ("host", "", "host"), ("gpu", "", "host"),      # no GPU buffers on the host: the next kind
    ("auto", "shards", "host"), ("off", "shards", "host"),
])
def test_a_version_is_staged_as_asked_or_refused_and_its_bytes_arrive(agents, monkeypatch, asked, refuse, through):
    monkeypatch.setenv(staging.REFUSE_ENV, refuse)
    server, reader = agents
    backend = HostClientBackend()
    src, dst = shards(fill=True), shards(fill=False)
    served = staging.register(server, src, backend, "m@1", fill=True, asked=asked)
    into = staging.register(reader, dst, backend, "the new version of m here", fill=False, asked=asked)
    try:
        for r in (served, into):
            assert (r.through, r.memory) == (through, "DRAM")
            assert r.staged == ("DRAM" if through else None)
            assert bool(r.refused) == bool(refuse)
            shard_regions = [(s.ptr, s.size, 0) for s in (src if r is served else dst)]
            assert (r.regions == shard_regions) == (through is None)
        if refuse:
            assert served.refused == "cannot register the host memory of m@1 with NIXL (NIXL_ERR_BACKEND)"
        read_all(reader, server, served, into)
        into.from_staged()   # staged: the bytes are in the buffers until copied into the shards
    finally:
        served.close()
        into.close()
    for s, d in zip(src, dst):
        assert d.array.tobytes() == s.array.tobytes()


@pytest.mark.parametrize("refuse", ["all", "shards,host"])
def test_everything_refused_fails_with_each_reason(agents, monkeypatch, refuse):
    monkeypatch.setenv(staging.REFUSE_ENV, refuse)
    server, _ = agents
    with pytest.raises(TransferFailed) as caught:
        staging.register(server, shards(fill=True), HostClientBackend(), "m@1", fill=True)
    assert str(caught.value) == ("cannot register the host memory of m@1 with NIXL (NIXL_ERR_BACKEND), nor a host "
                                 "buffer to stage it through (NIXL_ERR_BACKEND)")
