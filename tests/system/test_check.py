"""``python -m parallelx check`` on real scripts, under the real launchers.

Clean clients must check clean: the README's example on every default
backend (through the command line, with its JSON report), pytorch/examples'
MNIST (the protocol form, dropout), a script that steps in each loop form in
turn on every backend, pytorch/examples' ImageNet (augmentation
in DataLoader workers: level 1), HuggingFace's run_clm (GPT-2, AdamW,
accumulation: its attention key bias is rounding noise), a nanoGPT port
(random batches per rank: level 1), the CIFAR-10 recipe through its command
line.  Each broken script must exit 1 with its diagnosis.  To keep launches
few, each check runs the backends that matter for it (the reference and the
noise floor run in one process each, side by side)."""

from __future__ import annotations

import gzip
import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from launching import ROOT, require_launcher

from parallelx.check.report import COULD_NOT_RUN, DIFFERS, SAME, Report, from_dict
from parallelx.launching import runner
from parallelx.testing import check_script

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(900)]
#: Every check here but one representative runs in the second tier (each launches 3 to 8 runs).
scenario = pytest.mark.scenario

SCRIPTS = "tests/support/check_scripts"
#: The command line's own run: the backends that no client below covers.
CLI_BACKENDS = ["ddp", "horovod", "fsdp"]


def check(script: str, *args: str, backends: list[str], stages: tuple[int, ...] = (3,), nproc: int = 2) -> Report:
    for name in backends:
        require_launcher({"ddp": "torchrun", "fsdp": "torchrun", "horovod": "horovodrun"}.get(name, name))
    return check_script(script, *args, backends=backends, stages=stages, cwd=ROOT, timeout=300, nproc=nproc)


def summary(report: Report) -> str:
    return report.render()


# ---------------------------------------------------------------- clean clients
@scenario
def test_the_example_checks_clean_through_the_command_line(tmp_path):
    """The command line, its report also as JSON.  (DeepSpeed is checked below, at
    ZeRO 0 and 3, with the clients; docs/check.md shows the example on every backend.)"""
    for launcher in ("torchrun", "horovodrun"):
        require_launcher(launcher)
    out = tmp_path / "report.json"
    start = time.monotonic()
    done = runner.run(
        [sys.executable, "-m", "parallelx", "check", "--backends", ",".join(CLI_BACKENDS), "--report", str(out)]
        + ["--", "recipes/example.py", "--out", str(tmp_path / "example.pth")],
        timeout=800,
        cwd=ROOT,
    )
    seconds = time.monotonic() - start
    assert done.returncode == SAME, done.output[-4000:]
    report = from_dict(json.loads(out.read_text()))
    assert [r.label for r in report.rows] == CLI_BACKENDS
    assert report.level == 2 and report.floor_weights is not None and report.floor_weights > 0
    for row in report.rows:
        assert row.status == "same" and row.ranks_agree and row.steps == 3, summary(report)
        assert row.weights_vs_reference.worst <= row.weights_vs_reference.tolerance
        assert row.grads_vs_reference.worst <= row.grads_vs_reference.tolerance
    assert "verdict: exit 0: the same numbers on every backend" in done.output
    print(f"\n{report.render()}\nwall time of the check: {seconds:.1f} s")


@pytest.fixture(scope="module")
def mnist_dir(tmp_path_factory) -> Path:
    """Learnable stand-in digits in MNIST's raw files (IDX), which torchvision reads as the real ones."""
    root = tmp_path_factory.mktemp("mnist")
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    templates = rng.uniform(0, 255, size=(10, 28, 28))
    for split, n in (("train", 200), ("t10k", 75)):
        labels = rng.integers(0, 10, size=n)
        images = np.clip(templates[labels] * 0.6 + rng.normal(0, 60, size=(n, 28, 28)), 0, 255)
        for kind, array in (("images-idx3", images), ("labels-idx1", labels)):
            header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
            raw_file = raw / f"{split}-{kind}-ubyte"
            raw_file.write_bytes(header + array.astype(np.uint8).tobytes())
            (raw / f"{raw_file.name}.gz").write_bytes(gzip.compress(raw_file.read_bytes()))
    return root


@scenario
def test_mnist_port_checks_clean_in_the_protocol_form(mnist_dir):
    """backend.backward then a plain optimizer.step(), dropout, Adadelta: the reference
    steps once per 2 calls and replays each rank's dropout masks; ZeRO-3 steps by its engine,
    ZeRO 0 averages inside optimizer.step() (the gradients are read after that)."""
    args = ("--data-dir", str(mnist_dir))
    report = check("tests/support/clients/mnist_port.py", *args, backends=["deepspeed"], stages=(0, 3))
    assert report.exit_code == SAME and report.level == 2, summary(report)
    for label in ("deepspeed-zero0", "deepspeed-zero3"):
        row = report.row(label)
        assert row.status == "same" and row.steps == 3 and row.ranks_agree, summary(report)
        assert row.grads_vs_reference.worst <= row.grads_vs_reference.tolerance, summary(report)


# ---------------------------------------------------------------- the loop forms
FORMS = f"{SCRIPTS}/clean_loop_forms.py"


def assert_clean_in_every_form(report: Report, labels: list[str]) -> None:
    """Each run equals one process, its gradients read after its own averaging at every step
    (step 1's whole, the norm at each): no gradient read before it was final."""
    assert report.exit_code == SAME and report.level == 2, summary(report)
    assert [r.label for r in report.rows] == labels
    for row in report.rows:
        assert row.status == "same" and row.steps == 3 and row.ranks_agree, summary(report)
        assert row.first_step_out is None, summary(report)
        assert row.grads_vs_reference.worst <= row.grads_vs_reference.tolerance, summary(report)
        assert row.weights_vs_reference.worst <= row.weights_vs_reference.tolerance, summary(report)
    assert not any("before they were final" in n for n in report.notes), summary(report)


def test_every_loop_form_checks_clean_under_zero_0():
    """ZeRO 0 averages the gradients inside optimizer.step(): read after the backward, each
    rank's own were compared with one process's average (0.7 relative) and a correct script
    was told its arithmetic depends on how the batch is split.  Step 1 in the protocol form
    (loss.backward(), which DeepSpeed's ZeRO-0 engine refused on its own), step 2 the plain loop
    (backend.backward, optimizer.step()), step 3 backend.step."""
    report = check(FORMS, backends=["deepspeed"], stages=(0,))
    assert_clean_in_every_form(report, ["deepspeed-zero0"])


@scenario
def test_every_loop_form_checks_clean_on_every_backend():
    """Step 1 in the protocol form (loss.backward(), a plain optimizer.step()), step 2 the plain
    loop (backend.backward, optimizer.step()), step 3 backend.step: each backend averages
    somewhere else (ddp and fsdp in the backward, Horovod and DeepSpeed in the step), and the
    check reads every one after its own averaging.  ZeRO 0: the test above (in make test)."""
    report = check(FORMS, backends=["ddp", "horovod", "deepspeed", "fsdp"], stages=(1, 2, 3))
    assert_clean_in_every_form(
        report, ["ddp", "horovod", "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3", "fsdp"]
    )


def test_tensor_parallel_checks_clean_against_one_process_playing_the_data_ranks():
    """--tensor-parallel 2 at 4 processes: each backend that splits layers runs the script so, and the
    reference (one process, no split) plays the 2 data-parallel ranks.  The gradients are compared
    whole (a split layer's slices put together over its group): read as slices (tried), the check
    accused this correct script: step-1 gradients "inf" against the reference, exit 1."""
    # (fsdp too, measured: docs/check.md; its gradients are put together by the same part as ddp's.)
    report = check(FORMS, "--tensor-parallel", "2", backends=["ddp", "deepspeed"], stages=(1,), nproc=4)
    assert_clean_in_every_form(report, ["ddp", "deepspeed-zero1"])
    assert report.nproc == 2 and report.tensor_parallel == 2
    assert "4 processes (2 data-parallel x tensor parallel 2)" in summary(report)


@scenario
def test_tensor_parallel_peers_reading_different_batches_cannot_run(tmp_path):
    """nanoGPT seeds its data by backend.rank: the two ranks of a tensor-parallel group read
    different batches, which parallelx stops at the first forward; the check says so (exit 2)."""
    report = check(f"{SCRIPTS}/nanogpt_port.py", "--tensor-parallel", "2", backends=["ddp"])
    assert report.exit_code == COULD_NOT_RUN, summary(report)
    assert "read different batches" in summary(report) and "backend.mesh.data_rank" in summary(report)


@pytest.fixture(scope="module")
def imagenet_dir(tmp_path_factory) -> Path:
    """ImageFolder's layout (train/ and val/, a folder per class) with learnable
    stand-in JPEGs: 3 classes, 24 training and 8 validation images each, 40 px."""
    from PIL import Image

    root = tmp_path_factory.mktemp("imagenet")
    rng = np.random.default_rng(0)
    classes = ["n01440764", "n01443537", "n01484850"]
    templates = rng.uniform(0, 255, size=(len(classes), 3, 3, 3))
    for split, n in (("train", 24), ("val", 8)):
        for c, wnid in enumerate(classes):
            folder = root / split / wnid
            folder.mkdir(parents=True)
            coarse = np.kron(templates[c], np.ones((14, 14, 1)))[:40, :40]
            for i in range(n):
                pixels = np.clip(coarse + rng.normal(0, 40, size=coarse.shape), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{wnid}_{i}.JPEG", quality=90)
    return root


@scenario
def test_imagenet_port_checks_clean_with_augmentation_in_loader_workers(imagenet_dir, tmp_path):
    """pytorch/examples' ImageNet script (ResNet-18 with per-rank BatchNorm, SGD with
    momentum and weight decay, StepLR): RandomResizedCrop and the flip run in 2
    DataLoader workers per rank, seeded by the loader from torch's generator, so the
    backends are compared with each other (level 1).  ddp and fsdp here; every default
    backend (ddp, horovod, DeepSpeed ZeRO 0 and 3, fsdp) was run by hand through the
    command line: exit 0, each to the bit of ddp's weights."""
    args = [str(imagenet_dir), "--image-size", "32", "-b", "4", "-j", "2", "--lr", "0.01", "--seed", "0"]
    args += ["--epochs", "1", "--checkpoint-dir", str(tmp_path)]
    report = check("tests/support/clients/imagenet_port.py", *args, backends=["ddp", "fsdp"])
    assert report.exit_code == SAME, summary(report)
    # The reference reads in its main process, where the crops come from another generator than the workers'.
    assert report.level == 1 and "DataLoader workers" in report.level_reason, summary(report)
    for label in ("ddp", "fsdp"):
        row = report.row(label)
        assert row.status == "same" and row.steps == 3 and row.ranks_agree, summary(report)
    fsdp = report.row("fsdp").weights_vs_baseline
    assert fsdp.worst <= fsdp.tolerance, summary(report)
    assert any(f.cause == "batchnorm-per-rank" and not f.fails for f in report.findings), summary(report)


@scenario
def test_hf_gpt2_port_checks_clean_and_names_the_key_bias(tmp_path):
    pytest.importorskip("transformers")
    report = check("tests/support/clients/hf_clm_port.py", "--output_dir", str(tmp_path), backends=["deepspeed"])
    assert report.exit_code == SAME and report.level == 2, summary(report)
    zero3 = report.row("deepspeed-zero3").weights_vs_reference
    assert zero3.worst > 0  # ZeRO-3 sums each micro-batch apart: the same additions in another order
    assert zero3.worst <= zero3.tolerance
    noisy = [n for n in report.notes if "c_attn.bias" in n and "rounding noise" in n]
    assert noisy, report.notes


@scenario
def test_nanogpt_port_checks_clean_at_level_1():
    report = check(f"{SCRIPTS}/nanogpt_port.py", backends=["ddp", "fsdp"])
    assert report.exit_code == SAME, summary(report)
    assert report.level == 1 and "backend.make_sampler" in report.level_reason
    assert report.row("fsdp").weights_vs_baseline.worst <= report.row("fsdp").weights_vs_baseline.tolerance


@scenario
def test_cifar10_recipe_checks_clean_through_its_command_line(tmp_path):
    data = tmp_path / "cifar"
    made = runner.run(
        [sys.executable, "-m", "recipes.make_data", "cifar10", "--out", str(data), "--train", "300", "--test", "51"],
        timeout=120,
        cwd=ROOT,
    )
    assert made.returncode == 0, made.output
    args = ["--data-dir", str(data), "--epochs", "1", "--batch-size", "16", "--out-dir", str(tmp_path / "out")]
    report = check("-m recipes.cifar10", *args, backends=["ddp"])
    assert report.exit_code == SAME and report.level == 2, summary(report)
    assert report.row("ddp").weights_vs_reference.worst <= report.row("ddp").weights_vs_reference.tolerance


# ---------------------------------------------------------------- broken scripts
BROKEN = {
    "broken_rank_lr.py": ("rank-dependent-hyperparameters", "no backend.rank"),
    "broken_step_on_main.py": ("step-on-some-ranks", "on every rank"),
    "broken_unsharded.py": ("unsharded-loader", "sampler=backend.make_sampler(dataset)"),
    "broken_unseeded_init.py": ("initial-weights", "seed before building the model"),
    "broken_unseeded_dropout.py": ("forward-randomness", "seed once at the start"),
    "broken_unseeded_augment.py": ("data-randomness", "seed every generator the data uses"),
    "broken_batchnorm.py": ("batchnorm-statistics", "backend.sync_batchnorm(model)"),
}


@scenario
@pytest.mark.parametrize("script", list(BROKEN))
def test_a_broken_script_exits_1_with_its_diagnosis(script):
    cause, fix = BROKEN[script]
    report = check(f"{SCRIPTS}/{script}", backends=["ddp"])
    assert report.exit_code == DIFFERS, summary(report)
    assert [f.cause for f in report.differences()] == [cause], summary(report)
    assert fix in report.differences()[0].fix


@scenario
def test_a_deepspeed_config_that_clips_is_a_backend_option_that_changes_the_math(tmp_path):
    report = check(
        "recipes/example.py",
        "--out",
        str(tmp_path / "ex.pth"),
        "--deepspeed-config",
        f"{SCRIPTS}/clipping_ds_config.json",
        backends=["deepspeed"],
        stages=(0,),
    )
    assert report.exit_code == DIFFERS, summary(report)
    assert [f.cause for f in report.differences()] == ["backend-option"]
    what = report.differences()[0].what
    assert "clip_grad_norm=0.25 (on the one-process reference: None)" in what and "gradient_clipping" in what
    row = report.row("deepspeed-zero0")
    assert row.status == "differs" and row.grads_vs_reference.worst == 0  # the gradients agree, the update not


@scenario
def test_a_script_that_cannot_run_exits_2(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(
        "import argparse, parallelx\np = argparse.ArgumentParser(); parallelx.add_arguments(p)\n"
        "args = p.parse_args()\nraise ValueError('no data here')\n"
    )
    done = runner.run(
        [sys.executable, "-m", "parallelx", "check", "--backends", "ddp", "--", str(script)], timeout=300, cwd=ROOT
    )
    assert done.returncode == COULD_NOT_RUN, done.output[-3000:]
    assert "ValueError: no data here" in done.output
    assert done.output.rstrip().splitlines()[-1].startswith("verdict: exit 2")
