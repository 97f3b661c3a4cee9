"""Optimizer state keyed by parameter name through ``backend.load_state_dict`` (torch's
``get_optimizer_state_dict`` form, parallelx's ``state.pt``), and the warning for a mixed
precision that no forward entered, in-process on the one-process backends.  The other backends
run the same optimizer-state check in their core launch (tests/launcher/test_state_by_name_launch.py)."""

from __future__ import annotations

import copy

import optstate_worker
import pytest
import torch
from optstate_worker import Tied, build, torch_named, train
from torch import nn

import parallelx
from parallelx import ParallelxError, log

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def backend():
    with parallelx.get_backend("single") as b:
        yield b


@pytest.mark.parametrize("name", ["single", "dp"])
def test_name_keyed_state_loads_and_continues_as_position_keyed(name):
    with parallelx.get_backend(name) as backend:
        rep = optstate_worker.check(backend)
    assert rep["torch_keys"] == ["emb.weight", "mid.bias", "mid.weight", "norm.bias", "norm.weight"]
    assert rep["loaded_is_saved"] and rep["continues_run"]
    assert rep["loaded_equal"] == {"position": True, "torch": True, "parallelx": True}
    assert rep["after_equal"] == {"position": True, "torch": True, "parallelx": True}
    assert "names parameter 'emb.wieght', which the model does not have" in rep["refused"]["name"]
    assert "'exp_avg' of 'mid.weight' has shape (6, 7), the parameter (6, 6)" in rep["refused"]["shape"]
    assert "1 parameter group(s)" in rep["refused"]["groups"]


def _trained(backend):
    model, optimizer = build(backend, 0)
    train(backend, model, optimizer, 2)
    return model, optimizer, backend.optimizer_state_dict(optimizer)


def test_names_match_by_name_whatever_their_order(backend):
    """torch.optim would pair a name-keyed group with the live one by position: here the order of a
    group's names differs from the optimizer's, and each state still lands on its own parameter."""
    model, _, positional = _trained(backend)
    named = torch_named(positional)
    named["param_groups"][0]["params"] = list(reversed(named["param_groups"][0]["params"]))
    fresh, optimizer = build(backend, 1)
    backend.load_state_dict(optimizer, copy.deepcopy(named))
    for n, p in backend.unwrap(fresh).named_parameters():
        assert torch.equal(optimizer.state[p]["exp_avg"], named["state"][n]["exp_avg"]), n


def test_a_tied_weight_under_its_other_name_or_a_wrapper_prefix_loads(backend):
    _, _, positional = _trained(backend)
    named = torch_named(positional)
    other = {
        "state": {("out.weight" if k == "emb.weight" else f"module.{k}"): v for k, v in named["state"].items()},
        "param_groups": [
            {**g, "params": [("out.weight" if k == "emb.weight" else f"module.{k}") for k in g["params"]]}
            for g in named["param_groups"]
        ],
    }
    _, by_name = build(backend, 1)
    backend.load_state_dict(by_name, copy.deepcopy(named))
    _, by_alias = build(backend, 2)
    backend.load_state_dict(by_alias, copy.deepcopy(other))
    assert optstate_worker.same(backend.optimizer_state_dict(by_alias), backend.optimizer_state_dict(by_name))


def test_a_tied_weight_twice_or_an_entry_no_group_lists_is_refused(backend):
    _, _, positional = _trained(backend)
    named = torch_named(positional)
    twice = copy.deepcopy(named)
    twice["param_groups"][0]["params"].append("out.weight")
    _, optimizer = build(backend, 1)
    with pytest.raises(ParallelxError, match="list 'emb.weight' and 'out.weight', one parameter"):
        backend.load_state_dict(optimizer, twice)
    stray = copy.deepcopy(named)
    stray["param_groups"][1]["params"] = []
    with pytest.raises(ParallelxError, match="an entry for 'mid.weight', which none of its param_groups lists"):
        backend.load_state_dict(optimizer, stray)


def test_forms_that_cannot_be_told_apart_are_refused(backend):
    _, _, positional = _trained(backend)
    mixed = copy.deepcopy(positional)
    mixed["state"]["mid.weight"] = mixed["state"].pop(3)
    _, optimizer = build(backend, 1)
    with pytest.raises(ParallelxError, match="some parameters by name .'mid.weight'. and others by position"):
        backend.load_state_dict(optimizer, mixed)
    flat = {"state.mid.weight.exp_avg": torch.zeros(6, 6), "param_groups.mid.weight.lr": 1e-3}
    with pytest.raises(ParallelxError, match="flatten_optimizer_state_dict=False"):
        backend.load_state_dict(optimizer, flat)


def test_a_name_keyed_state_needs_one_model(backend):
    model, optimizer = build(backend, 0)
    both = backend.wrap_model(nn.Linear(2, 2))
    shared = torch.optim.SGD([*model.parameters(), *both.parameters()], lr=0.1)
    state = {"state": {}, "param_groups": [{**shared.state_dict()["param_groups"][0], "params": ["emb.weight"]}]}
    with pytest.raises(ParallelxError, match=r"2 of the models set up .*load_named_optimizer_state\(model, optimizer"):
        backend.load_state_dict(shared, state)


# ----------------------------------------------------------------- precision asked for, never entered
def _steps(backend, *, autocast: bool, steps: int = 2) -> None:
    model = backend.wrap_model(Tied())
    optimizer = backend.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.arange(4) % optstate_worker.VOCAB
    for _ in range(steps):
        with backend.autocast() if autocast else torch.enable_grad():
            loss = model(x).float().logsumexp(-1).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.fixture
def warnings(monkeypatch, capsys):
    monkeypatch.setattr(log, "_seen", set())  # a warning already said in this process is said again here

    def said() -> list[str]:
        return [line for line in capsys.readouterr().err.splitlines() if "backend.autocast()" in line]

    return said


@pytest.mark.parametrize("precision", ["bf16-mixed", "32"])
def test_a_mixed_precision_never_entered_is_said_once(warnings, precision):
    with parallelx.get_backend("single", precision=precision) as backend:
        _steps(backend, autocast=False, steps=3)
    said = warnings()
    if precision == "32":
        assert said == []
    else:
        assert len(said) == 1, said
        assert "precision bf16-mixed changes the forward only inside `with backend.autocast():`" in said[0]
        assert "computes in float32 as under precision 32" in said[0]


def test_a_mixed_precision_entered_says_nothing(warnings):
    with parallelx.get_backend("single", precision="bf16-mixed") as backend:
        _steps(backend, autocast=True)
    assert warnings() == []


def test_autocast_entered_before_set_options_still_counts(warnings):
    """The precision part is made again when the options change: what the script did stays known."""
    with parallelx.get_backend("single", precision="bf16-mixed") as backend:
        model = backend.wrap_model(Tied())
        optimizer = backend.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        with backend.autocast():
            loss = model(torch.arange(3)).float().sum()
        backend.set_options(clip_grad_norm=1.0)
        backend.backward(loss)
        backend.step(optimizer)
    assert warnings() == []


def test_weights_already_16_bit_need_no_autocast(warnings):
    """An engine that holds the weights in 16 bits (DeepSpeed's float16 engine), or the script's own
    ``model.half()``, computes the forward in 16 bits without autocast: nothing to say."""
    with parallelx.get_backend("single", precision="bf16-mixed") as backend:
        model = backend.wrap_model(Tied().to(torch.bfloat16))
        optimizer = backend.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        model(torch.arange(3)).float().sum().backward()
        optimizer.step()
    assert warnings() == []


def test_an_engines_own_16_bit_precision_does_not_count_as_autocast():
    from parallelx.parts.precision import EnginePrecision, Precision

    assert Precision("16-mixed").by_autocast and Precision("bf16-mixed").by_autocast
    assert not Precision("32").by_autocast
    assert EnginePrecision("bf16-mixed").by_autocast and not EnginePrecision("16-mixed").by_autocast
