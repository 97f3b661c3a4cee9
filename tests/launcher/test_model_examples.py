"""The several-models examples (``examples/gan.py``, ``examples/ema.py``,
``examples/distill.py``, docs/several-models.md) on every backend under its
real launcher, 2 processes on the CPU: one launch per backend runs the three
(``tests/support/examples_worker.py``; ZeRO 0, 1 and 2 share one DeepSpeed launch).  Every run exits 0; the final weights
of every model and of every average equal ddp's, and ddp's equal one
process's (the global batch is the same whatever the world size).

``python -m parallelx check`` compares the averages too: ``examples/ema.py``
checks clean on ddp, and the same script with its EMA updated on rank 0 only
(``tests/support/ema_on_main.py``) is found out by the averages' weights.

Tolerance: 1e-6 relative per tensor, float32 summation order over 32-36 Adam
steps.  Measured against ddp (gan, ema, distill; largest tensor): one process
1.8e-7, 1.3e-7, 3.3e-7; horovod and ZeRO 0-1 2.1e-7, 0, 0; ZeRO 2-3 and fsdp
1.0e-7, 0, 0.  The averages add no error of their own (elementwise).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from launching import ROOT, backend_cases, in_make_test, launch, require_launcher

from parallelx.testing import check_script

EXAMPLES = ("gan", "ema", "distill")
CASES: dict[str, tuple[str, str, list[str]]] = {"single": ("python", "single", []), **backend_cases()}
TOL = 1e-6

# Scenarios: three programs on every backend (the launches of tests/launcher/test_programs.py and
# test_ema_launch.py test their parts in make test).
pytestmark = [pytest.mark.launcher, pytest.mark.scenario, pytest.mark.timeout(1500)]

_done: dict[str, Path] = {}
#: DeepSpeed's stages that share one launch (examples_worker.py --stages); ZeRO-3 runs in make test, alone.
SHARED_STAGES = (0, 1, 2)


def run(case: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The case's launch (made once per module; the shared stages' one launch serves all three)."""
    if case not in _done:
        launcher, backend, extra = CASES[case]
        require_launcher(launcher)
        out = tmp_path_factory.mktemp(f"examples-{case}")
        shared = [f"deepspeed-zero{z}" for z in SHARED_STAGES]
        if case in shared:
            extra = ["--stages", *map(str, SHARED_STAGES)]
        nproc = 1 if backend == "single" else 2
        res = launch(
            launcher,
            ["tests/support/examples_worker.py", "--backend", backend, "--out", str(out), *extra],
            nproc=nproc,
            timeout=900 if case in shared else 500,
        )
        assert res.returncode == 0, f"{launcher} examples job of {case} failed:\n{res.tail(80)}"
        if case in shared:
            _done.update({c: out / f"zero{z}" for c, z in zip(shared, SHARED_STAGES)})
        else:
            _done[case] = out
    return _done[case]


def flat(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in flat(value, f"{prefix}/{key}").items()}
    return {}


def worst(out: Path, ref: Path, name: str) -> tuple[float, str]:
    a = flat(torch.load(out / name / "final.pt", weights_only=True))
    b = flat(torch.load(ref / name / "final.pt", weights_only=True))
    assert a.keys() == b.keys()
    errs = {
        k: float((a[k].double() - v.double()).norm() / max(float(v.double().norm()), 1e-30))
        for k, v in b.items()
        if v.is_floating_point()
    }
    key = max(errs, key=lambda k: errs[k])
    return errs[key], key


# make test runs the cases that shard (and ddp, the reference); the others are scenarios (CI runs both).
@pytest.mark.parametrize(
    "case",
    in_make_test(CASES, "single", "deepspeed-zero3"),
)
def test_the_examples_give_ddps_numbers(case, tmp_path_factory):
    out = run(case, tmp_path_factory)
    ref = run("single" if case == "ddp" else "ddp", tmp_path_factory)
    for name in EXAMPLES:
        err, where = worst(out, ref, name)
        print(f"\n{case} {name}: {err:.3g} at {where}")
        assert err < TOL, (case, name, err, where)
        # The averages are in the file and are not the model's own weights.
        saved = torch.load(out / name / "final.pt", weights_only=True)
        if name == "gan":
            assert not torch.equal(saved["ema"]["0.weight"], saved["g"]["0.weight"])
        if name == "ema":
            assert not torch.equal(saved["ema"]["0.weight"], saved["model"]["0.weight"])
        if name == "distill":  # the frozen encoder did not move from the teacher's first layer
            assert torch.equal(saved["student"]["encoder.weight"], saved["teacher"]["0.weight"])


def test_check_compares_the_averages(tmp_path):
    require_launcher("torchrun")
    args = ("--out-dir", str(tmp_path / "run"), "--ema-every", "1")
    clean = check_script("examples/ema.py", *args, backends=["ddp"], cwd=ROOT, timeout=300)
    assert clean.same, clean.render()
    broken = check_script("tests/support/ema_on_main.py", *args, backends=["ddp"], cwd=ROOT, timeout=300)
    text = broken.render()
    assert not broken.same, text
    assert "ema0." in text, text  # the diagnosis names an averaged tensor
