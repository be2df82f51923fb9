"""A writer and a reader of one size of object meet the same few ranges in turn: the tensor over a
range comes back for its next object where nobody holds it and it is as made, and each object reads
its own bytes. A tensor still held, or changed in place, is never handed out again."""

from __future__ import annotations

import weakref

import pytest

import ipcpool

pytestmark = pytest.mark.gpu

SIZE = 1 << 20


TYPED = {"dtype": "float32", "shape": [256, 1024]}   # (SIZE bytes)


def _hand_off(w, r, stream, i, *, keep=None, change=None, meta=None):
    """One object: created, filled with i % 251 through its tensor, sealed, read back by ``r``.
    ``keep``: a list the writer's tensor is kept in; ``change``: done to it before it is dropped;
    ``meta``: its dtype and shape (else bytes)."""
    buf = w.create(f"rt/{i}", SIZE, stream=stream, meta=meta)
    x = buf.tensor()
    shape = (SIZE,) if meta is None else tuple(meta["shape"])
    assert tuple(x.shape) == shape and x.is_contiguous() and not x.requires_grad
    seen = (weakref.ref(x), buf.carved_at)
    x.fill_(i % 251)
    buf.seal(stream=stream)
    lease = r.get(f"rt/{i}", stream=stream, timeout=30)
    y = lease.tensor()
    flat = y.view(-1)
    got = (int(flat[0].item()), int(flat[-1].item()), tuple(y.shape))
    del flat
    del y
    lease.release(stream=stream)
    if change is not None:
        change(x)
    if keep is not None:
        keep.append(x)
    del x
    w.delete(f"rt/{i}")
    return seen, got


@pytest.mark.parametrize("meta", [None, TYPED], ids=["bytes", "typed"])
def test_a_ranges_tensor_comes_back_for_its_next_object_and_reads_its_own_bytes(start_broker, meta):
    import torch

    b = start_broker(backend="cuda")
    stream = torch.cuda.Stream()
    shape = (SIZE,) if meta is None else tuple(meta["shape"])
    with ipcpool.connect(b.socket_dir) as w, ipcpool.connect(b.socket_dir) as r, torch.cuda.stream(stream):
        by_range, reused = {}, 0
        for i in range(60):
            (ref, where), got = _hand_off(w, r, stream, i, meta=meta)
            assert got == (i % 251, i % 251, shape)
            before = by_range.get(where)
            if before is not None and before() is not None and before() is ref():
                reused += 1
            by_range[where] = ref
        assert len(by_range) < 60 and reused > 0, (len(by_range), reused)


def test_a_tensor_still_held_or_changed_is_never_handed_out_again(start_broker):
    import torch

    b = start_broker(backend="cuda")
    stream = torch.cuda.Stream()
    with ipcpool.connect(b.socket_dir) as w, ipcpool.connect(b.socket_dir) as r, torch.cuda.stream(stream):
        held = []
        for i in range(20):   # each tensor kept: every object gets a tensor of its own
            (ref, _), got = _hand_off(w, r, stream, i, keep=held)
            assert got == (i % 251, i % 251, (SIZE,))
        assert len({id(x) for x in held}) == len(held)
        assert all(x.shape == (SIZE,) and not x.requires_grad for x in held)
        held.clear()

        def reshape(x):
            x.unsqueeze_(0)

        def shrink(x):
            x.resize_(SIZE // 2)

        for i in range(20, 60):   # each tensor changed in place before it is dropped
            (ref, _), got = _hand_off(w, r, stream, i, change=reshape if i % 2 else shrink)
            assert got == (i % 251, i % 251, (SIZE,))
