"""Start real launchers (torchrun, horovodrun, deepspeed) from tests, with a
hard timeout that kills the whole process tree: a hung collective fails its
test instead of hanging the run.  The command lines come from each backend's
own :class:`parallelx.launching.launchers.Launcher`, and the jobs run through
:mod:`parallelx.launching.runner`, as the command line's and the benchmarks' do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from parallelx import describe
from parallelx.launching import runner
from parallelx.launching.launchers import Launcher

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

# Which backend's launcher each launcher name means in the tests.
_BY_LAUNCHER = {"python": "single", "torchrun": "ddp", "horovodrun": "horovod", "deepspeed": "deepspeed"}


@dataclass
class Result:
    returncode: int
    output: str
    seconds: float

    def tail(self, n: int = 60) -> str:
        """The last ``n`` lines, after the lines that say why a process aborted when one did (a C++
        exception out of a transport's thread: they scroll out of the tail behind the stack dump)."""
        lines = self.output.splitlines()
        why = [ln for ln in lines[:-n] if any(k in ln for k in ("terminate called", "what():", "Fatal Python error"))]
        return "\n".join([*(["[why it aborted]", *why[:10], "[the tail]"] if why else []), *lines[-n:]])


#: Every distributed backend under its own launcher, DeepSpeed at each ZeRO
#: stage: test id -> (launcher, backend, extra arguments).  The parity tests
#: run each of them (or the ones named) on the same work.
BACKEND_CASES: dict[str, tuple[str, str, list[str]]] = {
    "ddp": ("torchrun", "ddp", []),
    "horovod": ("horovodrun", "horovod", []),
    **{f"deepspeed-zero{z}": ("deepspeed", "deepspeed", ["--zero-stage", str(z)]) for z in range(4)},
    "fsdp": ("torchrun", "fsdp", []),
}


def backend_cases(*names: str) -> dict[str, tuple[str, str, list[str]]]:
    """The named entries of :data:`BACKEND_CASES` (all of them when none is named)."""
    return {n: BACKEND_CASES[n] for n in (names or BACKEND_CASES)}


def in_make_test(cases: Iterable[str], *quick: str) -> list[Any]:
    """``cases``' names as pytest params: those in ``quick`` run in make test, the others are marked
    ``scenario`` (make test-scenarios, which CI runs too), to hold make test's time (15 minutes from
    a fresh clone).  Every backend runs under its own launcher in make test all the same: the core
    launch of each (``tests/support/core_runs.py``) runs the checks of five modules."""
    unknown = set(quick) - set(cases)
    assert not unknown, f"in_make_test: {sorted(unknown)} are not among {list(cases)}"
    return [c if c in quick else pytest.param(c, marks=pytest.mark.scenario) for c in cases]


def launcher_for(launcher: str) -> Launcher:
    return describe(_BY_LAUNCHER[launcher]).launcher


def launch(
    launcher: str, target: list[str], *, nproc: int = 2, timeout: float = 240, env: dict[str, str] | None = None
) -> Result:
    """Run ``target`` (``["-m", "mod", ...]`` or ``["file.py", ...]``) under ``launcher``."""
    done = runner.launch(
        launcher_for(launcher),
        target,
        nproc,
        timeout=timeout,
        cwd=ROOT,
        env={"PARALLELX_TIMEOUT": "120", **(env or {})},
    )
    if done.timed_out:
        pytest.fail(
            f"{launcher} job hung for more than {timeout:.0f}s and was killed:\n"
            + "\n".join(done.output.splitlines()[-40:])
        )
    return Result(done.returncode, done.output, done.seconds)


def deepspeed_together(cases: Iterable[str], *quick: str) -> tuple[str, ...]:
    """The DeepSpeed cases among ``cases`` that are not in ``quick`` (make test's): the scenarios'
    stages, which share one launch (``worker_reports(..., together=...)``)."""
    return tuple(c for c in cases if c.startswith("deepspeed-zero") and c not in quick)


_SHARED_LAUNCHES: dict[tuple[str, tuple[str, ...]], Path] = {}


def worker_reports(
    case: str,
    cases: dict[str, tuple[str, str, list[str]]],
    worker: str,
    tmp_path_factory: pytest.TempPathFactory,
    *,
    timeout: float,
    together: tuple[str, ...] = (),
) -> list[dict]:
    """Launch ``tests/support/<worker>`` for ``case`` of ``cases`` (launcher, backend, extra
    arguments) at 2 processes, and read back each rank's ``rank<r>.json`` from its ``--out``.

    ``together``: DeepSpeed cases (``--zero-stage S``) that share one launch, each stage in turn
    (``--stages``, ``tests/support/worker_cases.py``), when ``case`` is one of them: made once per
    session, ``timeout`` per stage."""
    launcher, backend, extra = cases[case]
    if case in together:
        key = (worker, together)
        if key not in _SHARED_LAUNCHES:
            require_launcher(launcher)
            stages = [cases[c][2][cases[c][2].index("--zero-stage") + 1] for c in together]
            rest = [a for c in together[:1] for a in cases[c][2]]
            at = rest.index("--zero-stage")
            rest = rest[:at] + rest[at + 2 :]
            out = tmp_path_factory.mktemp(f"{Path(worker).stem}-zero{''.join(stages)}")
            res = launch(
                launcher,
                [f"tests/support/{worker}", "--backend", backend, "--out", str(out), *rest, "--stages", *stages],
                timeout=timeout * len(stages),
            )
            assert res.returncode == 0, f"{launcher} {worker} job of {', '.join(together)} failed:\n{res.tail(80)}"
            _SHARED_LAUNCHES[key] = out
        out = _SHARED_LAUNCHES[key] / f"zero{extra[extra.index('--zero-stage') + 1]}"
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    require_launcher(launcher)
    out = tmp_path_factory.mktemp(f"{Path(worker).stem}-{case}")
    res = launch(
        launcher, [f"tests/support/{worker}", "--backend", backend, "--out", str(out), *extra], timeout=timeout
    )
    assert res.returncode == 0, f"{launcher} {worker} job of {case} failed:\n{res.tail(80)}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def run_with_grace(
    cmd: list[str], *, timeout: float, grace: float, what: str, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """Run a program that drives launches of its own (a benchmark, the GPU
    check) and return ``(exit status, output)``.  Past ``timeout`` it gets
    SIGTERM first, so that it can take down the launch it is running and write
    what it has; past ``grace`` more its whole process group is killed, and
    the test fails with the output's tail."""
    done = runner.run(cmd, timeout=timeout, grace=grace, env=env, cwd=ROOT)
    if done.timed_out:
        pytest.fail(f"{what} ran past {timeout:.0f}s:\n{done.output[-4000:]}")
    return done.returncode, done.output


def require_launcher(launcher: str) -> None:
    """Skip only when the launcher is genuinely not installed (never in CI,
    whose set-up installs all of them)."""
    if launcher_for(launcher).program_path() is None:
        if os.environ.get("CI"):
            pytest.fail(f"{launcher} is not installed; run scripts/setup.sh")
        pytest.skip(f"{launcher} is not installed")


# ------------------------------------------- jobs that are acted on while they run
def wait_for(
    predicate: Callable[[], bool], procs: subprocess.Popen | list[subprocess.Popen], what: str, timeout: float = 120
) -> None:
    """Poll ``predicate`` until it holds; fail the test if a launcher in
    ``procs`` ends first, or after ``timeout`` seconds."""
    procs = procs if isinstance(procs, list) else [procs]
    end = time.monotonic() + timeout
    while not predicate():
        if any(p.poll() is not None for p in procs):
            pytest.fail(f"the job ended (exit status {[p.returncode for p in procs]}) before {what}")
        if time.monotonic() > end:
            pytest.fail(f"no {what} after {timeout:.0f}s")
        time.sleep(0.05)


def latest_step(out: Path) -> int:
    """The step of the checkpoint ``out/checkpoints/latest`` names, -1 when there is none yet."""
    try:
        return int((out / "checkpoints" / "latest").read_text().strip().split("-")[1])
    except (OSError, IndexError, ValueError):
        return -1


def rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest relative difference (L2, per tensor) of state dict ``a`` from ``b``."""
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).norm() / max(float(b[k].double().norm()), 1e-12)) for k in b)


# Python code to run first in a process that must behave as if horovod and deepspeed were not installed.
BLOCK_BACKEND_PACKAGES = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('horovod', 'deepspeed'):
            raise ModuleNotFoundError(f'{name} is blocked for this test')
sys.meta_path.insert(0, _Block())
"""
