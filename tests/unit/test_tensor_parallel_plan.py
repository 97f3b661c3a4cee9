"""The tensor-parallel plan and its refusals, in-process (the trained numbers are
``tests/launcher/test_tensor_parallel.py``'s): which layers the default plan splits on the
models users train, a ``tp_plan`` in transformers' form, what is refused before anything
changes, the slicing that checkpoints use, and the backends that refuse ``--tensor-parallel``
at ``init()``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import parallelx
from parallelx.errors import ParallelxError
from parallelx.parts.mesh import Mesh, check_degree
from parallelx.tensor_parallel.part import local_slice, whole_from_slices
from parallelx.tensor_parallel.plan import find_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))


def recipe_gpt(heads: int = 4) -> nn.Module:
    from recipes.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=heads, n_embd=heads * 8, dropout=0.0))


def llama() -> nn.Module:
    from tp_worker import LlamaLM

    return LlamaLM()


def test_the_default_plan_splits_attention_by_heads_and_the_mlp() -> None:
    plan = find_plan(recipe_gpt(), 2)
    styles = {n: (s.style, s.parts) for n, s in plan.splits.items()}
    assert styles["transformer.h.0.attn.c_attn"] == ("colwise", 3)  # q, k, v fused: each split by heads
    assert styles["transformer.h.0.attn.c_proj"] == ("rowwise", 1)
    assert styles["transformer.h.1.mlp.c_fc"] == ("colwise", 1)
    assert styles["transformer.h.1.mlp.c_proj"] == ("rowwise", 1)
    # The tied embedding and head: the vocabulary split (one tensor, cut once), the logits gathered whole.
    assert plan.splits["transformer.wte"].style == "vocab" and plan.splits["lm_head"].gather
    assert len(styles) == 10
    assert plan.attention == {"transformer.h.0.attn": {"n_head": 4}, "transformer.h.1.attn": {"n_head": 4}}
    assert plan.kept_whole == ["transformer.wpe"]
    assert "8 layers" not in plan.describe(2) and "4 layers column-wise, 4 row-wise" in plan.describe(2)


def test_llama_from_transformers_gets_its_projections_split() -> None:
    plan = find_plan(llama(), 2)
    names = {n.split("layers.0.")[-1]: s.style for n, s in plan.splits.items() if "layers.0." in n}
    assert names == {
        "self_attn.q_proj": "colwise",
        "self_attn.k_proj": "colwise",
        "self_attn.v_proj": "colwise",
        "self_attn.o_proj": "rowwise",
        "mlp.gate_proj": "colwise",
        "mlp.up_proj": "colwise",
        "mlp.down_proj": "rowwise",
    }
    # 4 query heads and 2 key/value heads of 8: 2 ranks take 2 and 1 each; 4 ranks cannot share 2.
    with pytest.raises(ParallelxError, match=r"k_proj holds 2 heads of 8, which 4 ranks cannot share equally"):
        find_plan(llama(), 4)


def test_heads_the_ranks_cannot_share_are_refused_before_anything_changes() -> None:
    model = recipe_gpt(heads=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ParallelxError, match=r"n_head is 3, which 2 ranks cannot share equally"):
        find_plan(model, 2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_given_plan_in_transformers_form_wins_and_unknown_styles_are_refused() -> None:
    plan = find_plan(recipe_gpt(), 2, {"transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"})
    assert sorted(plan.splits) == [f"transformer.h.{i}.mlp.{n}" for i in (0, 1) for n in ("c_fc", "c_proj")]
    assert plan.source == "the given tp_plan" and plan.attention == {}
    with pytest.raises(ParallelxError, match="'diagonal' is not a style"):
        find_plan(recipe_gpt(), 2, {"transformer.h.*.mlp.c_fc": "diagonal"})
    with pytest.raises(ParallelxError, match="names no module"):
        find_plan(recipe_gpt(), 2, {"blocks.*.fc": "colwise"})


def test_a_model_it_cannot_plan_is_refused_by_name() -> None:
    with pytest.raises(ParallelxError, match="splits no layer of Sequential"):
        find_plan(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), 2)

    class Conv1D(nn.Module):  # transformers' GPT-2 layer: its weight transposed
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(8, 24))

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.o_proj = Conv1D(), nn.Linear(8, 8)
            self.num_heads = 2

    with pytest.raises(ParallelxError, match="q_proj is a Conv1D, not an nn.Linear.*transposed"):
        find_plan(nn.ModuleDict({"attn": Attention()}), 2)

    class Headless(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(8, 8) for _ in range(4))

    with pytest.raises(ParallelxError, match="keeps neither a head count .* nor a head_dim"):
        find_plan(nn.ModuleDict({"attn": Headless()}), 2)


@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("dim", [0, 1])
def test_slices_put_together_give_the_whole_tensor(parts: int, dim: int) -> None:
    whole = torch.randn(12, 6) if dim == 0 else torch.randn(6, 12)
    for size in (1, 2, 4 if parts == 1 else 2):
        slices = [local_slice(whole, dim, parts, r, size) for r in range(size)]
        assert torch.equal(whole_from_slices(slices, dim, parts), whole)
    if parts == 3 and dim == 0:  # fused q, k, v: rank 1 of 2 holds the second half of each
        q, k, v = whole.chunk(3)
        assert torch.equal(local_slice(whole, 0, 3, 1, 2), torch.cat([q[2:], k[2:], v[2:]]))


def test_the_degree_must_divide_the_world() -> None:
    check_degree(2, 4, "fsdp")
    with pytest.raises(ParallelxError, match=r"--tensor-parallel 3 does not divide the world of 4 processes.*1, 2, 4"):
        check_degree(3, 4, "fsdp")


NO_HOROVOD = pytest.mark.skipif(
    parallelx.describe("horovod").unavailable_reason() is not None,
    reason="Horovod is not installed here (make test's set-up leaves out its build; make setup builds it)",
)


@pytest.mark.parametrize("name", ["single", "dp", pytest.param("horovod", marks=NO_HOROVOD)])
def test_backends_without_tensor_parallelism_refuse_it_at_init_by_name(name: str) -> None:
    backend = parallelx.get_backend(name, tensor_parallel=2, device="cpu", verbose=False)
    with pytest.raises(
        ParallelxError, match=rf"{name} cannot split layers over ranks \(--tensor-parallel 2\).*--backend fsdp"
    ):
        backend.init()
    assert not backend.initialized


def test_the_option_on_the_command_line_and_sequence_parallel_needs_it() -> None:
    parser = parallelx.add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--backend", "fsdp", "--tensor-parallel", "2", "--sequence-parallel", "--loss-parallel"])
    backend = parallelx.from_args(args)
    assert backend.run.tensor_parallel_size == 2 and backend.run.sequence_parallel and backend.run.loss_parallel
    with pytest.raises(ParallelxError, match="--sequence-parallel .* needs --tensor-parallel N"):
        parallelx.get_backend("fsdp", sequence_parallel=True)
    with pytest.raises(ParallelxError, match="--loss-parallel .* vocabulary shards: it needs --tensor-parallel N"):
        parallelx.get_backend("ddp", loss_parallel=True)


def test_without_tensor_parallelism_the_mesh_is_the_world() -> None:
    with parallelx.get_backend("single", device="cpu", verbose=False) as backend:
        assert backend.mesh == Mesh(data_rank=0, data_size=1)
        assert backend.mesh.tp_size == 1 and not backend.mesh.tensor_parallel


def test_the_check_plans_tensor_parallel_runs_and_a_reference_without_the_option() -> None:
    from parallelx.check import runs

    target = ["train.py", "--lr", "0.1", "--tensor-parallel", "2", "--sequence-parallel"]
    assert runs.tensor_parallel_degree(target) == 2 and runs.tensor_parallel_degree(["t.py"]) == 1
    assert runs.tensor_parallel_degree(["t.py", "--tensor-parallel=4"]) == 4
    # The reference (one process) splits nothing: both options dropped, the script's own kept.
    assert runs.without_tensor_parallel(target) == ["train.py", "--lr", "0.1"]
    specs = runs.plan(["ddp"], (), 4, tp=2)
    assert [(s.label, s.nproc, s.tp, s.data_ranks) for s in specs] == [("ddp", 4, 2, 2)]
    with pytest.raises(ParallelxError, match="--tensor-parallel 2 must divide the check's --nproc 3"):
        runs.plan(["ddp"], (), 3, tp=2)
    with pytest.raises(ParallelxError, match="horovod cannot split layers"):
        runs.plan(["horovod"], (), 2, tp=2)
    with pytest.raises(ParallelxError, match="takes a whole number"):
        runs.tensor_parallel_degree(["t.py", "--tensor-parallel", "two"])


def test_deepspeed_refuses_zero_3_with_tensor_parallel_when_built() -> None:
    with pytest.raises(ParallelxError, match=r"ZeRO 0, 1 and 2 only .* --zero-stage 1 or 2, or --backend fsdp"):
        parallelx.get_backend("deepspeed", zero_stage=3, tensor_parallel=2)
    parallelx.get_backend("deepspeed", zero_stage=2, tensor_parallel=2)  # built; the launch tests train it


def test_deepspeeds_own_autotp_section_is_refused_with_the_option_that_replaces_it() -> None:
    config = {"tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 1}}
    with pytest.raises(ParallelxError, match=r"autotp_size 2\) is DeepSpeed's own .* give --tensor-parallel 2"):
        parallelx.get_backend("deepspeed", config=config)


def test_the_estimate_counts_one_ranks_share_of_the_split_layers() -> None:
    from parallelx.bigmodels.estimate import count_model
    from parallelx.tensor_parallel.plan import split_shares

    model = recipe_gpt()
    plan = find_plan(model, 2)
    whole = count_model(model)
    modules = dict(model.named_modules())
    tensors = {
        id(t): t
        for n, s in plan.splits.items()
        for t in (modules[n].weight, getattr(modules[n], "bias", None))
        if t is not None and (s.style != "rowwise" or t.dim() == 2)
    }  # a tied weight once
    split = sum(t.numel() for t in tensors.values())
    share = count_model(model, split_shares(model, plan, 2))
    assert share.numel == whole.numel - split // 2 and share.param_bytes == 4 * share.numel


def test_loss_parallel_on_a_model_without_an_output_head_is_refused_before_anything_changes() -> None:
    from collections import OrderedDict

    from parallelx.tensor_parallel.part import TensorParallel

    model = nn.Sequential(OrderedDict(fc1=nn.Linear(4, 8), act=nn.ReLU(), fc2=nn.Linear(8, 2)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    part = TensorParallel(Mesh(data_rank=0, data_size=1, tp_rank=0, tp_size=2), loss_parallel=True)
    with pytest.raises(ParallelxError, match="--loss-parallel .* splits no output head .* leave --loss-parallel out"):
        part.apply(model, torch.device("cpu"), "ddp")
    assert type(model.fc1) is nn.Linear and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
