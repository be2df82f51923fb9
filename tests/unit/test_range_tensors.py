"""A tensor over a slab range is handed out again for the range's next object only where nobody
holds it and it is as it was made (``rangetensors.RangeTensors``). Stand-in tensors: the check reads
only their public attributes and the count of references (real tensors: tests/gpu)."""

from __future__ import annotations

from ipcpool._client.rangetensors import RangeTensors

U8, F32 = object(), object()


class FakeTensor:
    def __init__(self, ptr: int, shape: tuple, strides: tuple, dtype: object):
        self.ptr, self.shape, self.strides, self.dtype = ptr, shape, strides, dtype
        self.requires_grad = False
        self.grad = None

    def data_ptr(self) -> int:
        return self.ptr

    def stride(self) -> tuple:
        return self.strides


def _kept(ranges: RangeTensors, key=("slab", 0, 64)) -> FakeTensor:
    return ranges.keep(key, FakeTensor(1000, (64,), (1,), U8))


def test_a_tensor_nobody_holds_comes_back_for_its_range():
    ranges = RangeTensors()
    made_id = id(_kept(ranges))   # (the caller dropped it)
    again = ranges.get(("slab", 0, 64), 1000, (64,), (1,), U8)
    assert again is not None and id(again) == made_id


def test_a_tensor_someone_holds_is_not_handed_out_twice():
    ranges = RangeTensors()
    held = _kept(ranges)
    assert ranges.get(("slab", 0, 64), 1000, (64,), (1,), U8) is None
    del held
    assert ranges.get(("slab", 0, 64), 1000, (64,), (1,), U8) is not None


def test_a_tensor_changed_in_place_is_not_handed_out():
    changes = [
        ("shape", (1, 64)), ("strides", (2,)), ("ptr", 2000), ("dtype", F32), ("requires_grad", True),
        ("grad", object()),
    ]
    for field, value in changes:
        ranges = RangeTensors()
        setattr(_kept(ranges), field, value)   # (what resize_, set_, requires_grad_ ... would leave)
        assert ranges.get(("slab", 0, 64), 1000, (64,), (1,), U8) is None, field


def test_another_range_or_no_tensor_yet_gets_none():
    ranges = RangeTensors()
    _kept(ranges)
    assert ranges.get(("slab", 64, 64), 1064, (64,), (1,), U8) is None
    assert RangeTensors().get(("slab", 0, 64), 1000, (64,), (1,), U8) is None


def test_the_ranges_remembered_are_bounded():
    ranges = RangeTensors()
    for k in range(RangeTensors.MAX + 10):
        _kept(ranges, ("slab", k, 64))
    assert len(ranges._kept) <= RangeTensors.MAX
    ranges.clear()
    assert ranges.get(("slab", RangeTensors.MAX + 9, 64), 1000, (64,), (1,), U8) is None
