"""A pool's slabs as VMM chunks, as pure logic: chunk creation is a stand-in here (the GPU suite
makes real ones)."""

import contextlib

import pytest

slabs = pytest.importorskip("ipcpool.backend.cuda.slabs", exc_type=ImportError)

from ipcpool.errors import OutOfMemory  # noqa: E402

MiB = 1 << 20


class FakeChunk:
    def __init__(self, size, made):
        self.size, self.fd, self.made = size, 100 + len(made), made
        made.append(self)

    def close(self):
        self.made.remove(self)


@pytest.fixture
def vmm_slabs(monkeypatch):
    made = []
    monkeypatch.setattr(slabs.vmm, "create_chunks", lambda device, sizes, compression: [FakeChunk(s, made) for s in sizes])
    monkeypatch.setattr(slabs, "OnDevice", lambda device: contextlib.nullcontext())
    budget = {"left": 2 * 128 * MiB}

    def room(n):
        if n > budget["left"]:
            raise OutOfMemory("would pass its max_size")
        budget["left"] -= n

    s = slabs.Slabs("p", None, 1 << 30, lambda: pytest.fail("a VMM slab needs no stream"), vmm_device=0, room=room)
    return s, made


def test_vmm_slabs_are_chunks_named_by_a_key_and_bounded_by_the_pool(vmm_slabs):
    s, made = vmm_slabs
    assert s.size == 128 * MiB and s.item_max == 8 * MiB   # an eighth of a 1 GiB pool
    first, offset = s.take(8 * MiB)
    assert first.chunk is made[0] and first.buffer is None and first.chunks == (128 * MiB,)
    assert len(first.data) == 64 and offset == 0
    assert s.reserved == 128 * MiB and s.pool_reserved == 0   # the driver's pool count has none of it
    for _ in range(15 + 16):   # fills the first slab, then a second
        s.take(8 * MiB)
    assert len(made) == 2 and made[0] is not made[1]
    with pytest.raises(OutOfMemory, match="max_size"):
        s.take(8 * MiB)   # a third slab would pass max_size: none is made
    assert len(made) == 2 and s.reserved == 256 * MiB
    keys = {sl.data for sl in s._slabs}
    assert len(keys) == 2   # each slab its own key
    s.close()
    assert made == []
