"""A user's own script (pytorch/examples' MNIST, ported from the README) under
every launcher: it runs, and at the same world size prints the same figures on
ddp, horovod and deepspeed, dropout and an LR schedule included."""

from __future__ import annotations

import gzip
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from launching import launch, require_launcher

# Scenarios: users' scripts ported from their docs, each under three or five launchers.
pytestmark = [pytest.mark.launcher, pytest.mark.scenario, pytest.mark.timeout(600)]

SCRIPT = "tests/support/clients/mnist_port.py"
RUNS = {
    "ddp": ("torchrun", []),
    "horovod": ("horovodrun", []),
    "deepspeed-zero3": ("deepspeed", ["--zero-stage", "3"]),
}


def _write_idx(path: Path, array: np.ndarray) -> None:
    """MNIST's IDX format: magic (0, 0, dtype 0x08, ndim), big-endian sizes, the bytes."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


@pytest.fixture(scope="module")
def mnist_dir(tmp_path_factory) -> Path:
    """Learnable stand-in digits in MNIST's raw files (torchvision reads them as the real ones)."""
    root = tmp_path_factory.mktemp("mnist")
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    templates = rng.uniform(0, 255, size=(10, 28, 28))
    for split, n in (("train", 200), ("t10k", 75)):
        labels = rng.integers(0, 10, size=n)
        images = np.clip(templates[labels] * 0.6 + rng.normal(0, 60, size=(n, 28, 28)), 0, 255)
        _write_idx(raw / f"{split}-images-idx3-ubyte", images)
        _write_idx(raw / f"{split}-labels-idx1-ubyte", labels)
        # torchvision looks for the unpacked files; the .gz are what a download leaves beside them.
        for kind in ("images-idx3", "labels-idx1"):
            name = raw / f"{split}-{kind}-ubyte"
            (raw / f"{name.name}.gz").write_bytes(gzip.compress(name.read_bytes()))
    return root


def figures(output: str) -> list[str]:
    """The lines the script prints on the main rank: losses, test figures, learning rates."""
    text = re.sub(r"\[\d+\]<std(out|err)>:", "", output)  # horovodrun's prefixes
    return [ln.strip() for ln in text.splitlines() if ln.strip().startswith(("Train Epoch:", "Test set:", "lr "))]


@pytest.fixture(scope="module")
def printed(mnist_dir) -> dict[str, list[str]]:
    out = {}
    for name, (launcher, extra) in RUNS.items():
        require_launcher(launcher)
        res = launch(launcher, [SCRIPT, "--data-dir", str(mnist_dir), *extra], timeout=240)
        assert res.returncode == 0, f"{name}:\n{res.tail()}"
        out[name] = figures(res.output)
    return out


def test_the_port_prints_its_figures_once(printed):
    for name, lines in printed.items():
        assert sum(ln.startswith("Test set:") for ln in lines) == 2, (name, lines)  # 2 epochs, main rank only
        assert [ln for ln in lines if ln.startswith("lr ")] == ["lr 0.700000", "lr 0.490000"], name


def test_same_figures_on_every_backend(printed):
    reference = printed["ddp"]
    for name, lines in printed.items():
        assert lines == reference, f"{name} differs from ddp:\n" + "\n".join(
            f"{a}    |    {b}" for a, b in zip(reference, lines) if a != b
        )


def test_the_port_runs_in_one_process(mnist_dir, tmp_path):
    res = launch(
        "python",
        [
            SCRIPT,
            "--data-dir",
            str(mnist_dir),
            "--backend",
            "single",
            "--epochs",
            "1",
            "--save-model",
            str(tmp_path / "m.pt"),
        ],
        timeout=120,
    )
    assert res.returncode == 0, res.tail()
    assert any(ln.startswith("Test set:") for ln in figures(res.output))
    assert (tmp_path / "m.pt").is_file()


# --------------------------------------------- HuggingFace's run_clm_no_trainer, ported
HF_SCRIPT = "tests/support/clients/hf_clm_port.py"
# ZeRO-0 is ddp's arithmetic through DeepSpeed's engine, and horovod gives ddp's bits on every GPT of the core
# launches (groups, tied weights, accumulation): the client runs where its own breaks were: ZeRO-2, ZeRO-3, fsdp.
HF_RUNS = {
    "ddp": ("torchrun", []),
    "deepspeed-zero2": ("deepspeed", ["--zero-stage", "2"]),
    "deepspeed-zero3": ("deepspeed", ["--zero-stage", "3"]),
    "fsdp": ("torchrun", ["--backend", "fsdp", "--fsdp-shard", "auto"]),
}
#: ddp's bits: they reduce each accumulation window once, in ddp's order.
HF_BITWISE = {"fsdp"}


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory) -> dict[str, dict]:
    pytest.importorskip("transformers")
    out = {}
    for name, (launcher, extra) in HF_RUNS.items():
        require_launcher(launcher)
        folder = tmp_path_factory.mktemp(f"hf-{name}")
        res = launch(launcher, [HF_SCRIPT, "--output_dir", str(folder), *extra], timeout=300)
        assert res.returncode == 0, f"{name}:\n{res.tail()}"
        out[name] = {
            "lines": figures_hf(res.output),
            "model": torch.load(folder / "model.pt", weights_only=True)["model"],
            "checkpoints": sorted(p.name for p in (folder / "checkpoints").glob("step-*")),
        }
    return out


def figures_hf(output: str) -> list[str]:
    text = re.sub(r"\[\d+\]<std(out|err)>:", "", output)
    return [ln.strip() for ln in text.splitlines() if ln.strip().startswith(("epoch ", "saved "))]


def test_hf_port_runs_and_checkpoints_everywhere(hf_runs):
    for name, run in hf_runs.items():
        assert len([ln for ln in run["lines"] if ln.startswith("epoch ")]) == 2, (name, run["lines"])
        assert run["checkpoints"] == ["step-00000005"], name  # 8 optimizer steps, a checkpoint every 5
        assert all("_orig_mod" not in k and not k.startswith("module.") for k in run["model"]), name


def test_hf_port_matches_ddp(hf_runs):
    """fsdp gives ddp's weights to the bit.  ZeRO 2 and 3
    reduce every micro-batch as it comes, so they sum the window in another
    order: within float32 rounding amplified by 8 AdamW steps, except GPT-2's
    attention key bias, whose gradient is exactly zero (a softmax does not
    see a shift of every score), so that AdamW turns pure rounding noise
    into steps of the learning rate's size."""
    ref = hf_runs["ddp"]["model"]
    for name, run in hf_runs.items():
        got = run["model"]
        assert got.keys() == ref.keys()
        if name in HF_BITWISE or name == "ddp":
            assert all(torch.equal(got[k], ref[k]) for k in ref), name
            assert run["lines"][:2] == hf_runs["ddp"]["lines"][:2], name  # the two epochs' figures
            continue
        worst = {
            k: float((got[k].double() - ref[k].double()).norm() / ref[k].double().norm().clamp_min(1e-30))
            for k in ref
            if ref[k].is_floating_point()
        }
        noisy = {k for k in worst if k.endswith("attn.c_attn.bias")}
        assert max(v for k, v in worst.items() if k not in noisy) < 1e-5, (name, worst)
