"""A torch nn.Module's workers attach a checkpoint and compute exactly what the original does
(host backend; skips without torch)."""

import pytest

import ipcpool
from tests.support.procs import run_procs

torch = pytest.importorskip("torch")


def make_model(seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 16),
                            torch.nn.BatchNorm1d(4), torch.nn.Linear(16, 50, bias=False))
    m[4].weight = m[0].weight                           # tied, as a language model's head often is
    m.eval()
    return m


def tokens():
    return torch.arange(8).reshape(2, 4) % 50


def _worker(socket_dir, copy, q):
    from ipcpool.weights.modules import bind_module

    with ipcpool.connect(socket_dir) as c, c.attach("lm", kind="torch") as ck:
        model = bind_module(make_model(seed=99), ck.tensors, copy=copy)
        with torch.no_grad():
            out = model(tokens())
        shared = model[2].weight.data_ptr() == ck.tensors["2.weight"].data_ptr()
        q.put((out.numpy().tobytes(), shared, model[4].weight is model[0].weight))


def test_workers_produce_exactly_the_original_logits(broker):
    model = make_model()
    with torch.no_grad():
        want = model(tokens()).numpy().tobytes()
    with ipcpool.connect(broker.socket_dir) as c:
        sd = {k: v for k, v in model.state_dict().items() if k != "4.weight"}   # (tied: saved once)
        assert c.publish_tensors("lm", sd) == 1
        results = run_procs(_worker, [(str(broker.socket_dir), False)] * 3 + [(str(broker.socket_dir), True)])
    assert all(out == want for out, _, _ in results)
    assert sorted(shared for _, shared, _ in results) == [False, True, True, True]   # the copy owns its memory
    assert all(tied for _, _, tied in results)


def test_a_mismatch_is_named(broker):
    from ipcpool.weights.modules import bind_module

    model = make_model()
    sd = {k: v for k, v in model.state_dict().items() if k != "4.weight"}
    with ipcpool.connect(broker.socket_dir) as c:
        c.publish_tensors("lm", sd)
        with c.attach("lm") as ck:
            wrong = torch.nn.Sequential(*make_model())
            wrong[2] = torch.nn.Linear(16, 8)
            with pytest.raises(ipcpool.InvalidRequest, match=r"'2.weight': the module has shape \[8, 16\], the checkpoint \[16, 16\]"):
                bind_module(wrong, ck.tensors)
            half = make_model().half()
            with pytest.raises(ipcpool.InvalidRequest, match="'0.weight': the module has dtype float16, the checkpoint float32"):
                bind_module(half, ck.tensors)
            with pytest.raises(ipcpool.InvalidRequest, match="no tensor '5.weight'"):
                bind_module(torch.nn.Sequential(*make_model(), torch.nn.Linear(50, 2)), ck.tensors)
            with pytest.raises(ipcpool.InvalidRequest, match="the checkpoint's tensor 'zz' is not in the module"):
                bind_module(make_model(), {**ck.tensors, "zz": ck.tensors["2.bias"]})
