"""The recipes, unmodified, under every backend's real launcher, on tiny
generated data; their metrics checked against a single-process evaluation.

CIFAR-10 runs here in one process (single, dp); under the multi-process
launchers it runs in tests/launcher/test_recipe_parity.py, whose launches
make the same checks besides comparing the weights across backends.
Dogs-vs-Cats (VGG16) runs under every launcher here; in one process once,
in the GPU check's dry run (tests/system/test_gpu_check.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from launching import in_make_test, launch, require_launcher
from recipe_outputs import check_cifar_metrics, check_outputs

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
    args = [
        *target,
        "--backend",
        name,
        *backend_args,
        "--data-dir",
        str(data_dir),
        "--out-dir",
        str(out_dir),
        "--epochs",
        "1",
        *extra,
    ]
    return launch(launcher, args, timeout=timeout)


WORLD = {"single": 1, "dp": 1, "ddp": 2, "horovod": 2, "deepspeed": 2}


@pytest.mark.launcher
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", in_make_test(["single", "dp"], "single"))
def test_cifar10_recipe(backend, cifar_dir, tmp_path):
    out = tmp_path / "out"
    res = run_recipe("cifar10", backend, cifar_dir, out, "--batch-size", "32")
    metrics = check_outputs(res, out, backend, WORLD[backend])
    check_cifar_metrics(metrics, out, cifar_dir, CIFAR_TEST)


@pytest.mark.launcher
@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", in_make_test([b for b in BACKENDS if b != "single"]))
def test_dogcat_recipe(backend, dogcat_dir, tmp_path):
    from recipes.data import load_dogcat
    from recipes.models import evaluate_state_dict, vgg16_for_dogcat

    out = tmp_path / "out"
    res = run_recipe(
        "dogcat",
        backend,
        dogcat_dir,
        out,
        "--image-size",
        "32",
        "--batch-size",
        "4",
        "--max-steps",
        "2",
        "--lr",
        "0.001",
    )
    metrics = check_outputs(res, out, backend, WORLD[backend])
    model = vgg16_for_dogcat(weights=out / "best.pth")  # our own 2-class file loads as --weights
    ref = evaluate_state_dict(model, load_dogcat(dogcat_dir, 32)[1])
    assert ref["count"] == 5
    assert metrics["best_val_acc"] == ref["acc"]
    assert metrics["final_val_loss"] == pytest.approx(ref["loss"], rel=1e-5)
