"""The cluster-engine tests' shared work: the CIFAR-10 recipe on a tiny
generated set, run under torchrun once as the reference, then under Slurm and
Ray Train, whose runs must end with the reference's weights.

128 training images, 2 processes x 16 images x ``--accumulate 2``: 2 optimizer
steps per epoch, 4 in all, under a cosine schedule with warm-up.
``OMP_NUM_THREADS=1`` everywhere: a process's thread count decides the
summation order inside conv and matmul kernels on the CPU (torchrun sets 1
when it starts several processes on a node; srun and Ray do not all do so).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from launching import BIN, ROOT, rel_err

N_TRAIN, N_TEST = 128, 32
ARGS = [
    "--epochs",
    "2",
    "--batch-size",
    "16",
    "--num-workers",
    "0",
    "--lr",
    "0.05",
    "--accumulate",
    "2",
    "--lr-schedule",
    "cosine",
    "--warmup-epochs",
    "0.5",
]
TIMING = ("epoch_time_s", "train_images_per_s", "val_images_per_s")


def make_data(out: Path) -> Path:
    from recipes.make_data import make_cifar10

    make_cifar10(out, n_train=N_TRAIN, n_test=N_TEST, seed=0)
    return out


def job_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for key in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "RAY_ADDRESS",
    ):
        env.pop(key, None)
    env.update(
        PYTHONUNBUFFERED="1",
        PARALLELX_TIMEOUT="60",
        PYTHONFAULTHANDLER="1",
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        **extra,
    )
    return env


def run(
    cmd: list[str],
    env: dict[str, str],
    log: Path,
    *,
    timeout: float,
    while_running: Callable[[subprocess.Popen], None] | None = None,
) -> tuple[int, str]:
    """Run ``cmd`` in its own session, output to ``log``; (exit status, output).
    Past ``timeout`` the whole session is killed and the test fails with the tail."""
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
    try:
        if while_running is not None:
            while_running(proc)
        proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        kill_session(proc)
        pytest.fail(f"{' '.join(cmd[:6])} ran past {timeout:.0f}s:\n{tail(log)}")
    finally:
        kill_session(proc)
    return proc.returncode, log.read_text(errors="replace").replace("\r", "\n")


def kill_session(proc: subprocess.Popen) -> None:
    import psutil

    try:
        os.killpg(proc.pid, 9)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        psutil.Process(proc.pid).wait(10)
    except psutil.NoSuchProcess:
        pass
    proc.poll()


def tail(log: Path, n: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").replace("\r", "\n").splitlines()[-n:])


def weights(out: Path, name: str = "last.pth") -> dict[str, torch.Tensor]:
    return torch.load(out / name, weights_only=True)


def history(out: Path) -> list[dict[str, str]]:
    with open(out / "history.csv") as f:
        return [{k: v for k, v in row.items() if k not in TIMING} for row in csv.DictReader(f)]


def assert_bitwise(out: Path, ref: Path) -> None:
    a, b = weights(out), weights(ref)
    bad = [k for k in b if not torch.equal(a[k], b[k])]
    assert not bad, f"last.pth differs from the torchrun run's in {bad} (rel. error {rel_err(a, b):.3g})"
    assert history(out) == history(ref), "history.csv differs from the torchrun run's"


def assert_exact_metrics(out: Path, data: Path, backend: str, world: int = 2) -> None:
    """metrics.json names the backend and world, and its accuracy is what one
    process computes from best.pth."""
    from recipes.data import load_cifar10
    from recipes.models import LeNet, evaluate_state_dict

    metrics = json.loads((out / "metrics.json").read_text())
    assert (metrics["backend"], metrics["world_size"]) == (backend, world)
    model = LeNet()
    model.load_state_dict(weights(out, "best.pth"))
    ref = evaluate_state_dict(model, load_cifar10(data)[1])
    assert ref["count"] == N_TEST and metrics["best_val_acc"] == ref["acc"]


def resumed_from(output: str) -> list[str]:
    return [
        line.split("resuming from ", 1)[1].split(":", 1)[0] for line in output.splitlines() if "resuming from " in line
    ]


def reference_run(data: Path, out: Path) -> Path:
    """The plain recipe under torchrun, 2 processes, no checkpoint option."""
    from launching import launcher_for

    from parallelx.launching.launchers import free_port

    start = time.monotonic()
    cmd = launcher_for("torchrun").command(
        ["recipes/cifar10.py", "--backend", "ddp", "--data-dir", str(data), "--out-dir", str(out), *ARGS],
        2,
        port=free_port(),
    )
    rc, output = run(cmd, job_env(), out.parent / "reference.log", timeout=120)
    assert rc == 0, output[-3000:]
    print(f"torchrun reference: {time.monotonic() - start:.1f}s")
    return out
