"""``parallelx.EMA`` on one process against torch's ``AveragedModel``, bitwise:
the EMA and SWA functions, ``every``, ``use_buffers`` (BatchNorm), the swap, the
state dict both ways, the training-state checkpoint, and the refusals.  (Every
backend, sharded, resumed: tests/launcher/test_ema_launch.py.)"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn, get_swa_multi_avg_fn

import parallelx
from parallelx.errors import ParallelxError


@pytest.fixture
def backend():
    with parallelx.get_backend("single", device="cpu") as b:
        yield b


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 2))


def train(backend, every: int, use_buffers: bool, fn, steps: int = 7):
    ref = net()
    model = copy.deepcopy(ref)
    avg = AveragedModel(ref, multi_avg_fn=fn, use_buffers=use_buffers)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    model, opt = backend.setup(model, torch.optim.Adam(model.parameters(), lr=0.05))
    ema = parallelx.EMA(backend, model, multi_avg_fn=fn, every=every, use_buffers=use_buffers)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = torch.randn(8, 3, generator=g), torch.randn(8, 2, generator=g)
        backend.backward(((model(x) - y) ** 2).mean())
        backend.step(opt)
        ema.update()
        ((ref(x) - y) ** 2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if (step + 1) % every == 0:
            avg.update_parameters(ref)
    return model, ema, avg


# (torch's SWA function cannot average BatchNorm's integer counter: no SWA with use_buffers.)
@pytest.mark.parametrize(
    ("every", "use_buffers", "fn"),
    [
        (1, False, get_ema_multi_avg_fn(0.9)),
        (3, False, get_ema_multi_avg_fn(0.9)),
        (1, True, get_ema_multi_avg_fn(0.9)),
        (3, True, get_ema_multi_avg_fn(0.9)),
        (2, False, get_swa_multi_avg_fn()),
    ],
    ids=["ema-1", "ema-3", "ema-1-buffers", "ema-3-buffers", "swa-2"],
)
def test_equals_averaged_model_bitwise(backend, every, use_buffers, fn):
    model, ema, avg = train(backend, every, use_buffers, fn)
    mine, theirs = ema.model_state_dict(), avg.module.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert ema.n_averaged == int(avg.n_averaged) == 7 // every
    x = torch.randn(4, 3)
    model.eval()
    avg.eval()
    before = copy.deepcopy(model.state_dict())
    assert torch.equal(ema(x), avg(x))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # swapped back
    assert not torch.equal(mine["0.weight"], before["0.weight"])


def test_state_dict_loads_both_ways_and_through_a_checkpoint(backend, tmp_path):
    model, ema, avg = train(backend, 2, False, get_ema_multi_avg_fn(0.8))
    state = ema.state_dict()
    assert set(state) - set(avg.state_dict()) == {"ema_steps"}
    fresh = AveragedModel(net(), multi_avg_fn=get_ema_multi_avg_fn(0.8))
    fresh.load_state_dict(state, strict=False)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), avg.state_dict().values()))
    other = parallelx.EMA(backend, model, decay=0.8, every=2)
    other.load_state_dict(avg.state_dict())
    assert (other.n_averaged, other.steps) == (ema.n_averaged, 2 * ema.n_averaged)
    path = parallelx.save_training_state(
        backend, tmp_path, step=1, models={"m": model}, optimizers={}, counters={}, emas={"ema": ema}
    )
    again = parallelx.EMA(backend, model, decay=0.8, every=2)
    parallelx.load_training_state(backend, path, models={"m": model}, emas={"ema": again})
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), state.values()))
    with pytest.raises(ParallelxError, match="no weight average named 'other'"):
        parallelx.load_training_state(backend, path, models={"m": model}, emas={"other": again})


def test_refusals(backend):
    model, _ = backend.setup(net())
    with pytest.raises(ParallelxError, match="not a torch AveragedModel"):
        parallelx.EMA(backend, AveragedModel(model))
    with pytest.raises(ParallelxError, match="every"):
        parallelx.EMA(backend, model, every=0)
    with pytest.raises(ParallelxError, match="not both"):
        parallelx.EMA(backend, model, decay=0.9, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    with pytest.raises(ParallelxError, match="takes parallelx.EMA"):
        parallelx.save_training_state(backend, ".", step=0, models={"m": model}, counters={}, emas={"e": model})
