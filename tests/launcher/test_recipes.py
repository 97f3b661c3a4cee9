"""The recipes, unmodified, under every backend's real launcher, on tiny
generated data; their metrics checked against a single-process evaluation."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from launching import launch, require_launcher

# (launcher, --backend, extra args).  Val sets have odd sizes: 2 ranks must pad.
BACKENDS = {
    "single": ("python", "single", []),
    "dp": ("python", "dp", []),
    "ddp": ("torchrun", "ddp", []),
    "horovod": ("horovodrun", "horovod", []),
    "deepspeed": ("deepspeed", "deepspeed", ["--zero-stage", "2"]),
}
CIFAR_TEST = 51
DOGCAT_PER_CLASS = 13  # 26 images -> 21 train, 5 val


@pytest.fixture(scope="session")
def cifar_dir(tmp_path_factory) -> Path:
    from recipes.make_data import make_cifar10

    out = tmp_path_factory.mktemp("cifar")
    make_cifar10(out, n_train=300, n_test=CIFAR_TEST, seed=0)
    return out


@pytest.fixture(scope="session")
def dogcat_dir(tmp_path_factory) -> Path:
    from recipes.make_data import make_dogcat

    return make_dogcat(tmp_path_factory.mktemp("dogcat"), n_per_class=DOGCAT_PER_CLASS, seed=0, csv=True)


def run_recipe(recipe: str, backend: str, data_dir: Path, out_dir: Path, *extra: str, timeout: float = 300):
    launcher, name, backend_args = BACKENDS[backend]
    require_launcher(launcher)
    # The deepspeed launcher takes a script path; the others "-m recipes.X", as the README shows.
    target = [f"recipes/{recipe}.py"] if launcher == "deepspeed" else ["-m", f"recipes.{recipe}"]
    args = [*target, "--backend", name, *backend_args, "--data-dir", str(data_dir), "--out-dir", str(out_dir),
            "--epochs", "1", *extra]
    return launch(launcher, args, timeout=timeout)


def console_lines(output: str) -> list[str]:
    # tqdm redraws with carriage returns; horovodrun prefixes "[rank]<stdout>:".
    segs = [seg.strip() for line in output.splitlines() for seg in line.split("\r")]
    return [re.sub(r"^\[\d+\]<std(out|err)>:", "", seg).strip() for seg in segs if seg]


def check_outputs(res, out: Path, backend: str, world: int) -> dict:
    assert res.returncode == 0, res.tail()
    lines = console_lines(res.output)
    assert any(ln.startswith("train Loss: ") and " Acc: " in ln for ln in lines)
    assert any(ln.startswith("val Loss: ") and " Acc: " in ln for ln in lines)
    assert any(ln.startswith("Training complete in ") for ln in lines)
    assert sum(ln.startswith("Best val Acc: ") for ln in lines) == 1, "printed by the main rank only"
    assert sorted(p.name for p in out.iterdir()) == ["best.pth", "history.csv", "last.pth", "metrics.json",
                                                       "training_results.png"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["backend"] == backend and metrics["world_size"] == world
    import pandas as pd

    hist = pd.read_csv(out / "history.csv")
    assert list(hist.columns) == ["epoch", "train_loss", "train_acc", "val_loss", "val_acc", "epoch_time_s",
                                  "train_images_per_s", "val_images_per_s", "lr", "grad_norm", "optimizer_steps",
                                  "skipped_steps"]
    assert len(hist) == 1 and hist["val_acc"].iloc[0] == metrics["final_val_acc"]
    return metrics


WORLD = {"single": 1, "dp": 1, "ddp": 2, "horovod": 2, "deepspeed": 2}


@pytest.mark.launcher
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_cifar10_recipe(backend, cifar_dir, tmp_path):
    from recipes.data import load_cifar10
    from recipes.engine import evaluate_state_dict
    from recipes.models import LeNet

    out = tmp_path / "out"
    res = run_recipe("cifar10", backend, cifar_dir, out, "--batch-size", "32")
    metrics = check_outputs(res, out, backend, WORLD[backend])
    # The reported val accuracy is exactly what one process computes from best.pth.
    model = LeNet()
    model.load_state_dict(torch.load(out / "best.pth", map_location="cpu", weights_only=True))
    ref = evaluate_state_dict(model, load_cifar10(cifar_dir)[1])
    assert ref["count"] == CIFAR_TEST
    assert metrics["best_val_acc"] == ref["acc"]
    assert metrics["final_val_loss"] == pytest.approx(ref["loss"], rel=1e-5)


@pytest.mark.launcher
@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_dogcat_recipe(backend, dogcat_dir, tmp_path):
    from recipes.data import load_dogcat
    from recipes.engine import evaluate_state_dict
    from recipes.models import vgg16_for_dogcat

    out = tmp_path / "out"
    res = run_recipe("dogcat", backend, dogcat_dir, out, "--image-size", "32", "--batch-size", "4",
                     "--max-steps", "2", "--lr", "0.001")
    metrics = check_outputs(res, out, backend, WORLD[backend])
    model = vgg16_for_dogcat(weights=out / "best.pth")  # our own 2-class file loads as --weights
    ref = evaluate_state_dict(model, load_dogcat(dogcat_dir, 32)[1])
    assert ref["count"] == 5
    assert metrics["best_val_acc"] == ref["acc"]
    assert metrics["final_val_loss"] == pytest.approx(ref["loss"], rel=1e-5)
