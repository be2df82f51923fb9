"""A pool whose slabs are VMM chunks (``slab_memory = "vmm"``): objects carved from them travel
between processes as those from pool slabs do, a client maps each slab once from its FD, and the
pool's max_size bounds them."""

from __future__ import annotations

import pytest

import ipcpool
from ipcpool.errors import OutOfMemory
from tests.support.procs import run_procs, run_together
from tests.support.gpu import attach_all, tensor_reader, tensor_writer

pytestmark = pytest.mark.gpu

MiB = 1 << 20
VMM_SLABS = '[[pools]]\nname = "default"\nmax_size = "4G"\nslab_memory = "vmm"\n'   # 512 MiB slabs


def _one_by_one(socket_dir, names, out):
    import torch

    stream = torch.cuda.Stream()
    sums = []
    with ipcpool.connect(socket_dir) as c:
        for name in names:
            lease = c.get(name, stream=stream)
            with torch.cuda.stream(stream):
                sums.append(int(torch.from_dlpack(lease).view(torch.uint8).sum(dtype=torch.int64)))
            lease.release(stream=stream)
    out.put(sums)


def test_objects_in_vmm_slabs_reach_other_processes_one_by_one_and_as_a_batch(start_broker):
    """Twenty 30 MiB objects fill two 512 MiB slabs: a batch attach maps each slab once (its first
    lease fetches the FD) and views the rest; single gets do the same one lease at a time."""
    import torch

    b = start_broker(backend="cuda", config_text=VMM_SLABS)
    names = [f"v/{i}" for i in range(20)]
    stream = torch.cuda.Stream()
    with ipcpool.connect(b.socket_dir) as c:
        for i, name in enumerate(names):
            buf = c.create(name, 30 * MiB, stream=stream)
            with torch.cuda.stream(stream):
                torch.from_dlpack(buf).view(torch.uint8).fill_(i + 1)
            buf.seal(stream=stream)
        stream.synchronize()
        pool = c.stats()["pools"]["default"]
        assert pool["reserved"] >= 2 * 512 * MiB and pool["used"] >= 20 * 30 * MiB
        want = [(i + 1) * 30 * MiB for i in range(20)]
        batch, single = run_procs(attach_all, [(b.socket_dir, names)]) + run_procs(_one_by_one, [(b.socket_dir, names)])
        assert batch == want and single == want


def test_a_carved_handoff_from_a_vmm_slab(start_broker):
    """The writer's arena is a range of a VMM slab: carved creates, typed tensors, both sides."""
    b = start_broker(backend="cuda", config_text=VMM_SLABS)
    got = dict(run_together([(tensor_writer, (b.socket_dir, 30)), (tensor_reader, (b.socket_dir, 30))]))
    assert got["carved"] > 0
    assert [s[3] for s in got["seen"]] == [float(2 * i) for i in range(30)]
    assert all(s[:2] == ("torch.bfloat16", (64, 128)) and s[2] for s in got["seen"])


def test_vmm_slabs_count_against_max_size(start_broker):
    """A 1 GiB pool has 128 MiB slabs: the ninth slab would pass max_size, and the broker says so."""
    b = start_broker(backend="cuda", config_text='[[pools]]\nname = "default"\nmax_size = "1G"\nslab_memory = "vmm"\n')
    with ipcpool.connect(b.socket_dir, arena_bytes=0) as c:
        held = []
        with pytest.raises(OutOfMemory, match="max_size"):
            for _ in range(8 * 16 + 1):   # sixteen 8 MiB ranges a slab
                held.append(c.allocate(8 * MiB))
        assert len(held) == 8 * 16
        for buf in held:
            buf.free()
        held = [c.allocate(8 * MiB) for _ in range(4)]   # the broker lives on, and serves again
        assert all(buf.size == 8 * MiB for buf in held)
