"""Start real launchers (torchrun, horovodrun, deepspeed) from tests, with a
hard timeout that kills the whole process tree: a hung collective fails its
test instead of hanging the run.  The command lines come from each backend's
own :class:`parallelx.launch.Launcher`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from parallelx import backend_class
from parallelx.launch import Launcher, free_port

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# Which backend's launcher each launcher name means in the tests.
_BY_LAUNCHER = {"python": "single", "torchrun": "ddp", "horovodrun": "horovod", "deepspeed": "deepspeed"}


@dataclass
class Result:
    returncode: int
    output: str
    seconds: float

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.output.splitlines()[-n:])


#: Every distributed backend under its own launcher, DeepSpeed at each ZeRO
#: stage: test id -> (launcher, backend, extra arguments).  The parity tests
#: run each of them (or the ones named) on the same work.
BACKEND_CASES: dict[str, tuple[str, str, list[str]]] = {
    "ddp": ("torchrun", "ddp", []),
    "horovod": ("horovodrun", "horovod", []),
    **{f"deepspeed-zero{z}": ("deepspeed", "deepspeed", ["--zero-stage", str(z)]) for z in range(4)},
}


def backend_cases(*names: str) -> dict[str, tuple[str, str, list[str]]]:
    """The named entries of :data:`BACKEND_CASES` (all of them when none is named)."""
    return {n: BACKEND_CASES[n] for n in (names or BACKEND_CASES)}


def launcher_for(launcher: str) -> Launcher:
    return backend_class(_BY_LAUNCHER[launcher]).launcher


def launch(launcher: str, target: list[str], *, nproc: int = 2, timeout: float = 240,
           env: dict[str, str] | None = None) -> Result:
    """Run ``target`` (``["-m", "mod", ...]`` or ``["file.py", ...]``) under ``launcher``."""
    spec = launcher_for(launcher)
    port = free_port()
    cmd = spec.command(target, nproc if spec.multi_process else 1, port=port)
    full_env = dict(os.environ)
    # PYTHONFAULTHANDLER: a rank killed by a signal (a native abort) prints its Python stacks.
    full_env.update(PYTHONUNBUFFERED="1", PARALLELX_TIMEOUT="120", PYTHONFAULTHANDLER="1",
                    PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **spec.env())
    full_env.update(env or {})
    start = time.monotonic()
    try:
        return _run(launcher, cmd, full_env, timeout, start)
    finally:
        if spec.cleanup is not None:
            spec.cleanup(port)  # a crashed or killed rank cannot clean up after itself


def _run(launcher: str, cmd: list[str], full_env: dict[str, str], timeout: float, start: float) -> Result:
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{launcher} job hung for more than {timeout:.0f}s and was killed:\n"
                    + "\n".join(out.splitlines()[-40:]))
    return Result(proc.returncode, out, time.monotonic() - start)


def run_with_grace(cmd: list[str], *, timeout: float, grace: float, what: str,
                   env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run a program that drives launches of its own (a benchmark, the GPU
    check) and return ``(exit status, output)``.  Past ``timeout`` it gets
    SIGTERM first, so that it can take down the launch it is running and write
    what it has; past ``grace`` more its whole process group is killed, and
    the test fails with the output's tail."""
    full_env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        pytest.fail(f"{what} ran past {timeout:.0f}s:\n{output[-4000:]}")
    return proc.returncode, output


def require_launcher(launcher: str) -> None:
    """Skip only when the launcher is genuinely not installed (never in CI,
    whose set-up installs all of them)."""
    if launcher_for(launcher).program_path() is None:
        if os.environ.get("CI"):
            pytest.fail(f"{launcher} is not installed; run scripts/setup.sh")
        pytest.skip(f"{launcher} is not installed")


# ------------------------------------------- jobs that are acted on while they run
def wait_for(predicate: Callable[[], bool], procs: subprocess.Popen | list[subprocess.Popen], what: str,
             timeout: float = 120) -> None:
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
