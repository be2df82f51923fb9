import random

import pytest

from ipcpool.ranges import RangeAllocator
from ipcpool.errors import InvalidRequest, OutOfMemory


def test_allocations_are_aligned_and_disjoint():
    a = RangeAllocator(1 << 20, alignment=256)
    spans = []
    for n in (1, 255, 256, 257, 4096, 1000):
        off = a.allocate(n)
        assert off % 256 == 0
        spans.append((off, off + a.size_of(off)))
    spans.sort()
    assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))
    assert a.used == sum(e - s for s, e in spans)


def test_free_coalesces_back_to_one_block():
    a = RangeAllocator(1 << 16, alignment=256)
    offs = [a.allocate(1024) for _ in range(64)]
    with pytest.raises(OutOfMemory, match="no free block"):
        a.allocate(1)
    random.Random(7).shuffle(offs)
    for off in offs:
        a.free(off)
    assert a.used == 0
    assert a.free_blocks() == [(0, 1 << 16)]
    assert a.allocate(1 << 16) == 0


def test_random_workload_keeps_invariants():
    rng = random.Random(1)
    a = RangeAllocator(1 << 22, alignment=512)
    live = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            a.free(off)
            del live[off]
        else:
            try:
                off = a.allocate(rng.randint(1, 64 << 10))
            except OutOfMemory:
                continue
            live[off] = a.size_of(off)
        free = sum(s for _, s in a.free_blocks())
        assert free + a.used == a.capacity
    blocks = a.free_blocks()
    assert all(o1 + s1 < o2 for (o1, s1), (o2, _) in zip(blocks, blocks[1:])), "adjacent free blocks left unmerged"


def test_fragmentation_is_reported():
    a = RangeAllocator(4096, alignment=1024)
    offs = [a.allocate(1024) for _ in range(4)]
    a.free(offs[0])
    a.free(offs[2])
    with pytest.raises(OutOfMemory, match="fragmented"):
        a.allocate(2048)


def test_bad_frees_and_sizes():
    a = RangeAllocator(4096)
    with pytest.raises(InvalidRequest, match="not allocated"):
        a.free(0)
    with pytest.raises(InvalidRequest, match="positive"):
        a.allocate(0)
    off = a.allocate(10)
    a.free(off)
    with pytest.raises(InvalidRequest, match="not allocated"):
        a.free(off)


def test_taken_ranges_check_bounds_alignment_and_overlap():
    from ipcpool.ranges import TakenRanges

    t = TakenRanges(4096, 512)
    assert t.reserve(0, 100) == 512 and t.reserve(1024, 1024) == 1024
    for offset, nbytes, message in [(512, 600, "not free"), (1536, 512, "not free"), (0, 1, "not free"),
                                    (3584, 1024, "not free"), (100, 10, "not aligned")]:
        with pytest.raises(InvalidRequest, match=message):
            t.reserve(offset, nbytes)
    assert t.reserve(512, 512) == 512 and t.offsets() == [0, 512, 1024] and t.used == 2048
    assert t.free(512) == 512 and not t.taken(512) and t.reserve(512, 300) == 512
    with pytest.raises(InvalidRequest, match="not allocated"):
        t.free(2048)
