"""``--tensor-parallel`` under torchrun and the deepspeed launcher (``tests/support/tp_worker.py``): the
recipe's GPT, nanoGPT's model and a Llama from ``transformers`` (RoPE, RMSNorm, SwiGLU, grouped-query
attention) trained 3 AdamW steps (two parameter groups, accumulation 2, clipping active at 0.05)
through parallelx at tensor parallel 2 (2 processes) and 2 x data parallel 2 (4 processes), on ddp,
fsdp and DeepSpeed ZeRO 1 and 2, with and without ``--sequence-parallel``, each against one process
computing the global batch.

The tolerance is measured in the same process, every launch: the floor is the largest relative
difference per tensor between the one-process reference and the same run with its sums in other
orders (the batch's gradient taken in 2 and in 4 parts, and the run in float64).  Tensor parallelism
reorders every row-wise layer's sum and every head's attention; measured, it lands at 0.4x to 2.5x
that floor (docs/tensor-parallel.md), so four times the floor.  A wrong all-reduce, a norm summed
twice or a broadcast that overwrote a rank's slices moved the weights by 0.04 to 2 (measured while
building this).

The checkpoints move: each launch resumes the one before it (another degree, another backend) and
continues one more window, which equals its own uninterrupted run within the floor.  And the rest
of a script: a weight average (``parallelx.EMA``) whose checkpoint holds whole tensors,
``save_pretrained`` read back by ``transformers``, ``make_sampler`` / ``gather_in_order`` /
``MetricSums`` by the data-parallel rank, activation checkpointing (one launch), the loss on the
head's vocabulary shards (``--loss-parallel``: the fsdp 2D and the ZeRO-1 launches; the others compute
it on the gathered logits).  Models built on the
meta device (``parallelx.init_module()``) equal their eager builds, each rank computing only its
slices, and a Hugging Face folder is read straight into the split layers: each rank reads the bytes
it keeps and no more.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launching import launch

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(420)]

MODELS = ("recipe_gpt", "nanogpt", "llama")
FACTOR = 4.0

# name -> (backend, processes, options, the launch whose checkpoints it resumes); in order.
LAUNCHES = {
    "ddp-tp2": ("ddp", 2, ["--tensor-parallel", "2"], None),
    "fsdp-tp2xdp2-sp": ("fsdp", 4, ["--tensor-parallel", "2", "--sequence-parallel", "--loss-parallel"], "ddp-tp2"),
    "ddp-tp2xdp2": ("ddp", 4, ["--tensor-parallel", "2", "--activation-checkpointing"], "fsdp-tp2xdp2-sp"),
    "fsdp-tp2": ("fsdp", 2, ["--tensor-parallel", "2"], "ddp-tp2xdp2"),
    "ddp-tp1": ("ddp", 2, [], "fsdp-tp2xdp2-sp"),  # a 2D checkpoint at tensor parallel 1
    "fsdp-tp2xdp2": ("fsdp", 4, ["--tensor-parallel", "2"], "ddp-tp2"),
    "deepspeed-zero1-tp2": (
        "deepspeed",
        2,
        ["--zero-stage", "1", "--tensor-parallel", "2", "--loss-parallel"],
        "ddp-tp2",
    ),
    "deepspeed-zero2-tp2xdp2": ("deepspeed", 4, ["--zero-stage", "2", "--tensor-parallel", "2"], "fsdp-tp2xdp2-sp"),
}
QUICK = ("ddp-tp2", "fsdp-tp2xdp2-sp", "deepspeed-zero1-tp2")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, list[dict]]]:
    """Every launch this session asked for, in order (a later one resumes an earlier one's files)."""
    return {}


def run(name: str, runs: dict[str, tuple[Path, list[dict]]], tmp_path_factory) -> list[dict]:
    if name in runs:
        return runs[name][1]
    backend, n, options, resume = LAUNCHES[name]
    if resume is not None:
        run(resume, runs, tmp_path_factory)
    out = tmp_path_factory.mktemp(f"tp-{name}")
    extra = ["--resume-from", str(runs[resume][0])] if resume is not None else []
    res = launch(
        "deepspeed" if backend == "deepspeed" else "torchrun",
        ["tests/support/tp_worker.py", "--backend", backend, "--out", str(out), "--device", "cpu", *options, *extra],
        nproc=n,
        timeout=360,
    )
    assert res.returncode == 0, f"{name} failed:\n{res.tail(80)}"
    reports = [json.loads((out / f"report-{r}.json").read_text()) for r in range(n)]
    runs[name] = (out, reports)
    return reports


CASES = [name if name in QUICK else pytest.param(name, marks=pytest.mark.matrix) for name in LAUNCHES]


@pytest.mark.parametrize("name", CASES)
def test_each_model_matches_one_process_and_its_checkpoint_moves(name, runs, tmp_path_factory):
    reports = run(name, runs, tmp_path_factory)
    backend, n, options, resume = LAUNCHES[name]
    tp = int(options[options.index("--tensor-parallel") + 1]) if "--tensor-parallel" in options else 1
    meshes = [(r["mesh"]["data_rank"], r["mesh"]["tp_rank"]) for r in reports]
    assert meshes == [divmod(rank, tp) for rank in range(n)], meshes  # tensor-parallel innermost
    for model in MODELS:
        first = reports[0][model]
        assert first["shapes_whole"], f"{name}: {model}'s checkpoint holds slices, not whole tensors"
        assert first["diff"] <= FACTOR * first["floor"], (name, model, first["diff"], first["floors"], first["worst"])
        for r in reports[1:]:  # every rank gathered the same whole weights
            assert r[model]["diff"] == first["diff"], (name, model)
        if resume is not None:
            # Resumed from another degree's or backend's checkpoint, one more window: as the uninterrupted run.
            assert first["resumed_vs_uninterrupted"] <= FACTOR * first["floor"], (name, model, first)
    if tp > 1:
        assert all("read different batches" in (r["peers_caught"] or "") for r in reports), reports[0]["peers_caught"]
        assert "backend.mesh.data_rank" in reports[0]["peers_caught"]
        rest = [r["everything_else"] for r in reports]
        assert all(e["ema_whole"] for e in rest), "the weight average's checkpoint holds slices"
        assert rest[0]["pretrained_logits"] < 1e-5, rest[0]  # transformers reads save_pretrained's folder
        for e in rest:  # the folder read into a meta-built model's slices: only what each rank keeps
            into = e["pretrained_into_slices"]
            assert into["equal_logits"], into
            assert into["bytes_read"] == into["bytes_held"] < into["file_bytes"], into
            assert all(not differ for differ in e["meta_equal_eager"].values()), e["meta_equal_eager"]
        for rank, e in enumerate(rest):  # a group's ranks read the same shard; the shards cover the data once
            assert e["sampler"] == rest[(rank // tp) * tp]["sampler"]
            assert e["gathered_in_order"] and e["metric_count"] == 11, e
        shards = [i for e in rest[::tp] for i in e["sampler"]]
        assert sorted(set(shards)) == list(range(11))
