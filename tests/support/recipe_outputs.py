"""What a recipe run must leave behind, checked the same way by every test
that runs one: its console lines, its output files and its metrics, the
reported validation figures against one process's evaluation of ``best.pth``."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import pytest
import torch

HISTORY_COLUMNS = [
    "epoch",
    "train_loss",
    "train_acc",
    "val_loss",
    "val_acc",
    "epoch_time_s",
    "train_images_per_s",
    "val_images_per_s",
    "lr",
    "grad_norm",
    "optimizer_steps",
    "skipped_steps",
]
OUTPUT_FILES = ["best.pth", "history.csv", "last.pth", "metrics.json", "training_results.png"]


def console_lines(output: str) -> list[str]:
    # tqdm redraws with carriage returns; horovodrun prefixes "[rank]<stdout>:".
    segs = [seg.strip() for line in output.splitlines() for seg in line.split("\r")]
    return [re.sub(r"^\[\d+\]<std(out|err)>:", "", seg).strip() for seg in segs if seg]


def check_outputs(res, out: Path, backend: str, world: int, epochs: int = 1) -> dict:
    """The run ended well, printed its summary on the main rank only and wrote every output file."""
    assert res.returncode == 0, res.tail()
    lines = console_lines(res.output)
    assert any(ln.startswith("train Loss: ") and " Acc: " in ln for ln in lines)
    assert any(ln.startswith("val Loss: ") and " Acc: " in ln for ln in lines)
    assert any(ln.startswith("Training complete in ") for ln in lines)
    assert sum(ln.startswith("Best val Acc: ") for ln in lines) == 1, "printed by the main rank only"
    assert sorted(p.name for p in out.iterdir()) == OUTPUT_FILES
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["backend"] == backend and metrics["world_size"] == world
    import pandas as pd

    hist = pd.read_csv(out / "history.csv")
    assert list(hist.columns) == HISTORY_COLUMNS
    assert len(hist) == epochs and hist["val_acc"].iloc[-1] == metrics["final_val_acc"]
    return metrics


def check_cifar_metrics(
    metrics: dict, out: Path, data_dir: Path, n_test: int, epochs: int = 1, precision: str = "32"
) -> None:
    """The reported best val accuracy is exactly what one process computes from best.pth (under
    the run's autocast, as the recipe evaluates): the padding duplicates of the distributed
    sampler are left out of every figure."""

    from recipes.data import load_cifar10
    from recipes.models import LeNet, evaluate_state_dict

    model = LeNet()
    model.load_state_dict(torch.load(out / "best.pth", map_location="cpu", weights_only=True))
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    with torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext():
        ref = evaluate_state_dict(model, load_cifar10(data_dir)[1])
    assert ref["count"] == n_test
    assert metrics["best_val_acc"] == ref["acc"]
    if metrics["best_epoch"] == epochs:  # best.pth is then also the final model, whose val loss is reported
        assert metrics["final_val_loss"] == pytest.approx(ref["loss"], rel=1e-5)


GPT_HISTORY_COLUMNS = [
    "epoch",
    "train_loss",
    "val_loss",
    "epoch_time_s",
    "train_tokens_per_s",
    "val_tokens_per_s",
    "lr",
    "grad_norm",
    "optimizer_steps",
    "skipped_steps",
]


def check_gpt_outputs(res, out: Path, backend: str, world: int, epochs: int, sample_tokens: int) -> dict:
    """The GPT recipe ended well: its console lines (the summary and the sample on the main rank
    only, tokens/s in the progress bar), its output files, its history and metrics."""
    assert res.returncode == 0, res.tail()
    lines = console_lines(res.output)
    assert sum(ln.startswith("train loss: ") and " tokens/s: " in ln for ln in lines) == epochs, res.tail()
    assert sum(ln.startswith("val loss: ") for ln in lines) == epochs
    assert any(ln.startswith("Training complete in ") for ln in lines)
    assert sum(ln.startswith("Best val loss: ") for ln in lines) == 1, "printed by the main rank only"
    assert sum(ln == "sample:" for ln in lines) == 1, "the sample is printed by the main rank only"
    assert "tok_s=" in res.output, "tokens/s in the progress bar"
    assert sorted(p.name for p in out.iterdir()) == sorted(["checkpoints", *OUTPUT_FILES])
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["backend"] == backend and metrics["world_size"] == world
    assert len(metrics["sample"]) == sample_tokens + 1 and set(metrics["sample"]) <= set(metrics["vocab"])
    import pandas as pd

    hist = pd.read_csv(out / "history.csv")
    assert list(hist.columns) == GPT_HISTORY_COLUMNS
    assert len(hist) == epochs and hist["val_loss"].iloc[-1] == metrics["final_val_loss"]
    return metrics


def check_gpt_metrics(metrics: dict, out: Path, precision: str = "32") -> None:
    """The reported final validation loss is exactly what one process computes from last.pth over
    every validation window (under the run's autocast, as the recipe evaluates): each window counted
    once, the sampler's padding left out."""
    from parallelx import MetricSums
    from recipes.data import char_datasets
    from recipes.gpt import sequence_losses
    from recipes.make_data import generate_text
    from recipes.models import GPT, GPTConfig

    config = metrics["config"]
    shape = {k: v for k, v in metrics["model"].items() if k not in ("name", "parameters")}
    text = generate_text(config["generated_chars"], config["seed"])
    _, val_set, vocab = char_datasets(text, shape["block_size"], config["val_fraction"])
    assert "".join(vocab) == metrics["vocab"]
    model = GPT(GPTConfig(**shape))
    model.load_state_dict(torch.load(out / "last.pth", map_location="cpu", weights_only=True))
    model.eval()
    sums = MetricSums()
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext():
        for x, y in torch.utils.data.DataLoader(val_set, batch_size=64):
            sums.update(sequence_losses(model(x), y), None)
    ref = sums.compute()
    assert ref["count"] == len(val_set) and "acc" not in ref
    assert metrics["final_val_loss"] == pytest.approx(ref["loss"], rel=1e-5)
