"""``parallelx.init_module()``: a meta build replayed to the eager build's tensors, bitwise, in one
process (the backends' own paths run under their launchers in tests/launcher/test_bigmodels.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import parallelx
from parallelx.bigmodels.meta import Values, has_meta, materialize

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from bigmodels_worker import CFG, MODELS, tokens


def build(make, meta: bool, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    if meta:
        with parallelx.init_module():
            model = make()
    else:
        model = make()
    return model, torch.rand(3)


@pytest.mark.parametrize("name", list(MODELS))
def test_materialized_equals_eager_bitwise_and_the_random_stream_goes_on_as_eager(name):
    eager, after_eager = build(MODELS[name], meta=False)
    meta, after_meta = build(MODELS[name], meta=True)
    assert has_meta(meta) and torch.equal(after_eager, after_meta)
    params = list(meta.parameters())
    before = torch.get_rng_state()
    materialize(meta)
    assert torch.equal(before, torch.get_rng_state())  # the replay leaves the generator where it was
    assert [p is q for p, q in zip(params, meta.parameters(), strict=True)] == [True] * len(params)
    se, sm = eager.state_dict(), meta.state_dict()
    assert set(se) == set(sm) and all(torch.equal(se[k], sm[k]) for k in se)
    be, bm = dict(eager.named_buffers()), dict(meta.named_buffers())
    assert all(torch.equal(be[k], bm[k]) for k in be)
    x, _ = tokens(0, 0, 2, CFG)
    assert torch.equal(eager.eval()(x)[0], meta.eval()(x)[0])


def test_tensors_computed_one_at_a_time_in_any_order_equal_the_whole_replay():
    eager, _ = build(MODELS["gpt"], meta=False)
    meta, _ = build(MODELS["gpt"], meta=True)
    values = Values(meta, "test")
    names = [n for n, _ in eager.named_parameters()][::-1]  # reversed: each tensor's draws from its own state
    for n in names:
        slot = values.slot(n)
        assert slot is not None and torch.equal(values.whole(slot), eager.get_parameter(n)), n


class NewHead(nn.Module):
    """An output layer given a weight of its own after construction (``empty_like`` of the old one, drawn
    anew), as scripts untie a head or re-initialise one."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 64)
        self.head.weight = nn.Parameter(torch.empty_like(self.head.weight))
        nn.init.normal_(self.head.weight, std=0.02)
        self.scale = nn.Parameter(self.body.weight.new_ones(8))


def test_a_layout_only_factory_does_not_replay_the_tensor_it_copies_the_shape_of():
    eager, _ = build(NewHead, meta=False)
    meta, _ = build(NewHead, meta=True)
    values = Values(meta, "test")
    replayed: list[str] = []
    for rec in {id(r): r for r in values.recordings.values()}.values():
        run = rec._run
        rec._run = lambda event, real, run=run: replayed.append(getattr(event.func, "__name__", "")) or run(event, real)  # type: ignore[method-assign]
    for name in ("head.weight", "scale"):
        slot = values.slot(name)
        assert slot is not None and torch.equal(values.whole(slot), eager.get_parameter(name)), name
    # The new head: its empty_like and its draw; the old head's kaiming_uniform_ is not run, nor body's.
    assert replayed == ["empty_like", "normal_", "new_ones"], replayed
    materialize(meta)
    assert all(torch.equal(a, b) for a, b in zip(eager.state_dict().values(), meta.state_dict().values(), strict=True))


@pytest.mark.parametrize("backend_name", ["single", "dp"])
@pytest.mark.parametrize("how", ["init_module", "plain"])
def test_setup_on_one_process_backends(backend_name, how):
    if how == "plain":
        from bigmodels_worker import PlainNet

        torch.manual_seed(0)
        eager = PlainNet()
        meta = plain_build(PlainNet, init=PlainNet.init_weights)
    else:
        eager, _ = build(MODELS["rotary"], meta=False)
        meta, _ = build(MODELS["rotary"], meta=True)
    backend = parallelx.get_backend(backend_name, device="cpu")
    with backend:
        opt = torch.optim.AdamW(meta.parameters(), lr=1e-2)
        wm, om = backend.setup(meta, opt)
        assert om is not None and all(not p.is_meta for g in om.param_groups for p in g["params"])
        we = backend.wrap_model(eager)
        se, sm = backend.model_state_dict(we), backend.model_state_dict(wm)
        assert all(torch.equal(se[k], sm[k]) for k in se)


def test_a_tensor_made_outside_the_block_is_refused():
    with torch.device("meta"):
        outside = torch.empty(3)
    with parallelx.init_module():
        model = nn.Linear(3, 3)
        model.register_buffer("late", outside)
    with pytest.raises(parallelx.ParallelxError, match="init_module"):
        materialize(model)
    assert has_meta(model)  # refused before anything changed


def test_weight_files_read_by_rows_and_names_matched_with_prefixes(tmp_path):
    from safetensors.torch import save_file

    from parallelx.bigmodels.formats import match_names, normal_name, open_weights

    assert normal_name("module._orig_mod.h.0._checkpoint_wrapped_module.weight") == "h.0.weight"
    state = {"a.weight": torch.arange(12.0).view(4, 3), "b": torch.tensor(2.0)}
    save_file(state, str(tmp_path / "w.safetensors"))
    torch.save({f"module.{k}": v for k, v in state.items()}, tmp_path / "w.pt")
    for name in ("w.safetensors", "w.pt"):
        f = open_weights(tmp_path / name)
        assert f.bytes_read == 0  # the names and shapes come from the header
        key = next(n for n in f.names() if n.endswith("a.weight"))
        assert torch.equal(f.rows(key, 1, 3), state["a.weight"][1:3])
        assert f.bytes_read == 6 * 4
        m = match_names({"a.weight": ((4, 3), ["a.weight"]), "c": ((1,), ["c", "b"])}, f)
        assert m.missing == [] and m.unexpected == [] and m.misshaped == [("c", (1,), ())]
        with pytest.raises(parallelx.ParallelxError, match="mis-shaped: c"):
            m.check(strict=False, where=name)


def plain_build(make, seed: int = 0, init=None) -> nn.Module:
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = make()
    if init is not None:
        parallelx.init_weights(model, init)
    return model


@pytest.mark.parametrize("init", [False, True])
def test_a_plain_meta_build_gets_reset_parameters_and_init_weights_bitwise(init):
    from bigmodels_worker import PlainNet

    torch.manual_seed(0)
    eager = PlainNet(init=init)
    after_eager = torch.rand(3)
    meta = plain_build(lambda: PlainNet(init=init), init=PlainNet.init_weights if init else None)
    materialize(meta)
    assert torch.equal(after_eager, torch.rand(3))  # the set-up drew what the eager build drew
    se, sm = eager.state_dict(), meta.state_dict()
    assert set(se) == set(sm) and [k for k in se if not torch.equal(se[k], sm[k])] == []
    assert meta.emb.weight is meta.head.weight
    if not init:  # the check can fail: the init changes the values it is compared with
        other = PlainNet(init=True)
        assert not torch.equal(other.layer.linear1.weight, meta.layer.linear1.weight)


def test_the_recipe_gpt_under_plain_meta_with_its_init_weights_is_the_eager_one():
    from recipes.models import GPT, GPTConfig

    config = GPTConfig(vocab_size=50, n_layer=2, n_embd=32, n_head=2)
    torch.manual_seed(1)
    eager = GPT(config)
    meta = plain_build(lambda: GPT(config), seed=1, init=GPT.init_weights)
    materialize(meta)
    se, sm = eager.state_dict(), meta.state_dict()
    assert [k for k in se if not torch.equal(se[k], sm[k])] == []
    # Without its init_weights, the layers' own defaults: accepted, and different (the docs say so).
    bare = plain_build(lambda: GPT(config), seed=1)
    materialize(bare)
    assert not torch.equal(bare.lm_head.weight, eager.lm_head.weight)


def test_a_plain_meta_build_with_values_no_reset_gives_is_refused_naming_them():
    from bigmodels_worker import RotaryNet

    model = plain_build(RotaryNet)
    with pytest.raises(parallelx.ParallelxError) as info:
        materialize(model)
    message = str(info.value)
    assert "rot.inv_freq" in message and "gain" in message and "parallelx.init_module()" in message
    assert "parallelx.init_weights" in message
    assert has_meta(model)  # refused before anything changed


def test_init_weights_on_an_eager_model_runs_at_once():
    model = nn.Linear(3, 3)
    parallelx.init_weights(model, lambda m: nn.init.zeros_(m.weight))
    assert torch.equal(model.weight, torch.zeros(3, 3))
