"""One benchmark launch through :mod:`parallelx.launching.runner`, under its backend's
:class:`~parallelx.launching.launchers.Launcher`, with the environment every launch shares
and a check that it wrote its results."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import parallelx
from benchmarks.plan import IMPLS, Job, Machine
from benchmarks.workload import Plan, result_path
from parallelx.launching import runner

ROOT = Path(__file__).resolve().parents[1]


def unavailable(family: str) -> str | None:
    """Why ``family`` cannot run here (None when it can), without importing its package."""
    return runner.unavailable(parallelx.describe(family))


def run_job(job: Job, machine: Machine, work: Path, timeout_s: float) -> None:
    """Launch ``job`` under its backend's launcher, its output in a log; sets ``job.error`` (with the log's
    tail) when it failed or wrote no results.  The launch dies with this process even if that is killed
    (benchmarks run unattended for long)."""
    impl = IMPLS[job.impl]
    out, plan_file, log = job.out(work), work / "plans" / f"{job.tag}.json", work / "logs" / f"{job.tag}.log"
    plan_file.parent.mkdir(parents=True, exist_ok=True)
    Plan(
        impl=job.impl,
        nproc=job.nproc,
        threads=job.threads,
        out=str(out),
        cases=job.cases,
        bind_cores=machine.bind_cores,
    ).dump(plan_file)
    shutil.rmtree(out, ignore_errors=True)  # an earlier run's leftovers in a reused --work-dir would be read as ours
    print(f"[bench] {job.tag}: {' '.join(c.id for c in job.cases)}", flush=True)
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        # Every launcher gets the same explicit thread count (torchrun would otherwise force 1,
        # the others leave torch at all cores).
        "OMP_NUM_THREADS": str(job.threads),
        "MKL_NUM_THREADS": str(job.threads),
        "PARALLELX_TIMEOUT": str(int(timeout_s)),
    }
    begin = time.monotonic()
    done = runner.launch(
        parallelx.describe(impl.family).launcher,
        ["-m", impl.module, *impl.args, "--plan", str(plan_file), *job.extra_args],
        job.nproc,
        timeout=timeout_s,
        env=env,
        cwd=ROOT,
        log=log,
        die_with_parent=True,
    )
    job.seconds = time.monotonic() - begin
    missing = [c.id for c in job.cases if not result_path(out, job.impl, c, 0).is_file()]
    if (error := done.error()) is not None:
        job.error = f"{error} (log {log}):\n{done.tail(25)}"
    elif missing:
        job.error = f"exited 0 but wrote no results for {', '.join(missing)} (log {log})"
    print(f"[bench] {job.tag}: {'ok' if job.error is None else 'FAILED'} in {job.seconds:.1f}s", flush=True)
    if job.error:
        print(job.error, file=sys.stderr, flush=True)


def on_sigterm(signum: int, frame: object) -> None:
    """Installed by the command lines: unwinds through the runner, which kills the running launch."""
    raise SystemExit(128 + signum)
