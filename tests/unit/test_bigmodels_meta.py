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


# PyTorch's FSDP2 example (pytorch/examples, distributed/FSDP2/model.py) in shape: torch.nn's layers, each
# reset by its own constructor, under modules whose reset_parameters re-run their children's and that no
# __init__ calls (the example calls the root's only after to_empty).  The eager build is the layers' resets
# alone; a replay of every reset in post-order re-draws each random tensor once per composite above it.
class ToyAttention(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))

    def reset_parameters(self) -> None:
        for layer in (self.q, self.k, self.v, self.o):
            layer.reset_parameters()


class ToyMLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def reset_parameters(self) -> None:
        self.up.reset_parameters()
        self.down.reset_parameters()


class ToyBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(width), ToyAttention(width)
        self.norm2, self.mlp = nn.LayerNorm(width), ToyMLP(width)

    def reset_parameters(self) -> None:
        for child in (self.norm1, self.attn, self.norm2, self.mlp):
            child.reset_parameters()


class ToyBare(nn.Module):
    """The example's body with no reset of its own: 2 embeddings, 3 blocks, a norm, an output layer."""

    def __init__(self, vocab: int = 32, length: int = 8, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(length, width)
        self.blocks = nn.ModuleList(ToyBlock(width) for _ in range(depth))
        self.norm, self.out = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)


class Toy(ToyBare):
    """The example's root: its reset re-runs the resets of the layers it holds directly."""

    def reset_parameters(self) -> None:
        for layer in (self.tok, self.pos, self.norm, self.out):
            layer.reset_parameters()


class ToySome(ToyBare):
    """A root reset with its own init for some tensors (the embeddings and the output), never called."""

    def reset_parameters(self) -> None:
        for w in (self.tok.weight, self.pos.weight, self.out.weight):
            nn.init.normal_(w, std=0.02)


class ToyCalled(ToyBare):
    """A root whose __init__ ends with its reset, which re-initialises every tensor its own way (through the
    composites' resets, which their constructors do not call): the eager build ran it after the layers'."""

    def __init__(self) -> None:
        super().__init__()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for block in self.blocks:
            block.reset_parameters()
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.trunc_normal_(m.weight, std=0.02)


def differing(make) -> tuple[list[str], int, bool]:
    """The tensors of a plain meta build that differ from the eager build's after materialisation, how many
    there are, and whether the random numbers drawn afterwards are the eager ones."""
    torch.manual_seed(0)
    eager = make()
    after_eager = torch.rand(3)
    meta = plain_build(make)
    materialize(meta)
    se, sm = eager.state_dict(), meta.state_dict()
    return [k for k in se if not torch.equal(se[k], sm[k])], len(se), torch.equal(after_eager, torch.rand(3))


@pytest.mark.parametrize("make", [Toy, ToySome, ToyCalled, ToyBare], ids=lambda c: c.__name__)
def test_a_composite_reset_is_replayed_only_where_the_eager_build_ran_it(make, capsys):
    # Every reset replayed in post-order: 27 of the 41 tensors differed (every random one; ToyBare's 25, its
    # embeddings come before the blocks), and the random numbers after set-up too.
    assert differing(make) == ([], 41, True)
    assert "warning" not in capsys.readouterr().err  # matched: nothing to warn of


class ToyNorm(nn.Module):
    """An RMSNorm as torchtitan writes it: ones in __init__, a reset that no constructor calls sets them again."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class ToyNormed(ToyBare):
    def __init__(self) -> None:
        super().__init__()
        self.final = ToyNorm()


def test_a_reset_no_constructor_calls_is_still_replayed_for_tensors_nothing_else_sets(capsys):
    assert differing(ToyNormed) == ([], 42, True)
    assert "warning" not in capsys.readouterr().err


class ToyGain(ToyBare):
    """A root with a tensor of its own drawn in __init__, which only its reset (never called) sets again,
    along with the output layer's: nothing but that reset can give ``gain`` a value."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.randn(16))

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gain)
        self.out.reset_parameters()


def test_a_composite_reset_replayed_for_its_own_tensors_names_what_then_differs(capsys):
    diff, _, _ = differing(ToyGain)
    err = capsys.readouterr().err
    assert "out.weight" in diff  # what the warning says
    assert "ToyGain.__init__ does not call ToyGain.reset_parameters()" in err
    assert "gain" in err and "re-initialises out.weight" in err and "parallelx.init_module()" in err


def unreadable_root() -> type[nn.Module]:
    """A root whose source cannot be read (made by exec): its __init__ ends with its reset, over the blocks'."""
    code = (
        "class ToyHidden(ToyBare):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.reset_parameters()\n"
        "    def reset_parameters(self):\n"
        "        for block in self.blocks:\n"
        "            block.reset_parameters()\n"
    )
    namespace: dict[str, object] = {"ToyBare": ToyBare}
    exec(compile(code, "<generated>", "exec"), namespace)
    made = namespace["ToyHidden"]
    assert isinstance(made, type)
    return made


def test_a_composite_reset_whose_constructor_cannot_be_read_is_replayed_and_named(capsys):
    assert differing(unreadable_root()) == ([], 41, True)  # replayed after the layers', as its __init__ does
    err = capsys.readouterr().err
    assert "ToyHidden.reset_parameters() sets tensors that its children's own resets set" in err
    assert "blocks.0.attn.q.weight" in err and "cannot be read" in err and "parallelx.init_module()" in err


def test_which_constructors_run_their_reset_is_read_from_their_source():
    from parallelx.bigmodels.resets import constructor_runs

    class Indirect(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self._init()

        def _init(self) -> None:
            self.reset_parameters()

        def reset_parameters(self) -> None:
            pass

    class ByBase(ToyCalled):
        def __init__(self) -> None:
            ToyCalled.__init__(self)

    class Applied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.apply(lambda m: m.reset_parameters())

        def reset_parameters(self) -> None:
            pass

    reset = "reset_parameters"
    assert constructor_runs(nn.Linear, reset) and constructor_runs(nn.MultiheadAttention, "_reset_parameters")
    assert constructor_runs(Indirect, reset) and constructor_runs(ByBase, reset) and constructor_runs(ToyCalled, reset)
    assert constructor_runs(Toy, reset) is False and constructor_runs(ToyBlock, reset) is False
    assert constructor_runs(Applied, reset) is None and constructor_runs(unreadable_root(), reset) is None


def test_the_draws_of_a_meta_build_share_one_buffer():
    """The draws made and dropped at build time (to move the generator) go into one buffer grown to the
    largest: a tensor of their own each, freed at once, left holes in glibc's heap that the small
    allocations between two draws split; a 771 MiB GPT built so held 1.27 GiB of RSS, now 20 MiB
    (docs/big-models.md, "Measured")."""
    from torch.overrides import TorchFunctionMode

    drawn: list[torch.Tensor] = []

    class Seen(TorchFunctionMode):  # under init_module's mode: sees the draws it makes on real tensors
        def __torch_function__(self, func, types, args=(), kwargs=None):
            target = args[0] if args else (kwargs or {}).get("tensor")  # nn.init's pass it by name
            name = getattr(func, "__name__", "")
            draw = name.endswith("uniform_") or name == "normal_"
            if draw and isinstance(target, torch.Tensor) and not target.is_meta:
                drawn.append(target)  # kept: a freed buffer's address could come back
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    with Seen(), parallelx.init_module():
        nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)], nn.Embedding(100, 64))
    storages = {t.untyped_storage().data_ptr() for t in drawn}
    # A weight and a bias a layer, then the embedding: the buffer grown once, for the embedding.
    assert len(drawn) == 17 and len(storages) == 2, (len(drawn), len(storages))


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def test_a_transformers_model_gets_its_own_initialisation_under_init_module():
    # transformers leaves its _init_weights out when it sees the meta device: without parallelx running
    # it, every Linear kept nn.Linear's default (std 0.10 here against the config's 0.02), silently.
    eager, after_eager = build(tiny_llama, meta=False)
    meta, after_meta = build(tiny_llama, meta=True)
    assert torch.equal(after_eager, after_meta)
    materialize(meta)
    se, sm = eager.state_dict(), meta.state_dict()
    assert [k for k in se if not torch.equal(se[k], sm[k])] == []


def test_weights_given_to_an_inner_module_are_the_ones_set_up(tmp_path):
    # load_pretrained on a wrapper's inner model, the wrapper set up: the file's values, not the build's.
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = tiny_llama()

    source = tiny_llama()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1.0)
    torch.save(source.state_dict(), tmp_path / "weights.pt")
    with parallelx.init_module():
        model = Wrapper()
    parallelx.load_pretrained(model.inner, tmp_path / "weights.pt")
    materialize(model)
    ss, sm = source.state_dict(), model.inner.state_dict()
    assert [k for k in ss if not torch.equal(ss[k], sm[k])] == []


@pytest.mark.parametrize("dim, parts", [(0, 1), (0, 3), (1, 1), (1, 2)])
def test_a_cut_meta_tensor_reads_only_its_slice_of_the_whole(tmp_path, dim, parts):
    # Tensor parallelism cuts a meta tensor to one rank's slice before it has values; its value is then
    # read, rows or columns, from the whole as each backend asks (fsdp: a few rows of the slice).
    from safetensors.torch import save_file

    from parallelx.bigmodels.meta import cut
    from parallelx.tensor_parallel.part import local_slice

    whole = torch.arange(12 * 12, dtype=torch.float32).reshape(12, 12)
    save_file({"layer.weight": whole}, tmp_path / "w.safetensors")
    for rank in range(2):
        with parallelx.init_module():
            model = nn.Sequential()
            model.add_module("layer", nn.Linear(12, 12, bias=False))
        weights = parallelx.load_pretrained(model, tmp_path / "w.safetensors")
        cut(model, model.layer.weight, dim, parts, rank, 2)
        values = Values(model, "test")
        slot = values.slot("layer.weight")
        expected = local_slice(whole, dim, parts, rank, 2)
        assert tuple(model.layer.weight.shape) == tuple(expected.shape)
        assert torch.equal(values.rows(slot), expected)
        rows = expected.shape[0]
        assert torch.equal(values.rows(slot, 1, rows - 1), expected[1 : rows - 1])
        assert weights.bytes_read == (expected.numel() + expected[1 : rows - 1].numel()) * 4  # its slice, no more
