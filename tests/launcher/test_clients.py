"""A user's own script (pytorch/examples' MNIST, ported from the README) under
every launcher: it runs, and at the same world size prints the same figures on
ddp, horovod and deepspeed, dropout and an LR schedule included."""

from __future__ import annotations

import gzip
import re
from pathlib import Path

import numpy as np
import pytest
from launching import launch, require_launcher

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(600)]

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
