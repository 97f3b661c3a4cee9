"""One benchmark launch through :mod:`parallelx.runner`: the command line from
its backend's :class:`~parallelx.launch.Launcher` (or the peer framework's),
the environment every launch shares, and a check that it wrote its results."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import parallelx
from benchmarks.plan import IMPLS, Job, Machine
from benchmarks.workload import Plan, result_path
from parallelx import runner
from parallelx.launch import Launcher

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Peer:
    """A framework compared with parallelx that is not its backend: what launching reads of a backend class."""

    requires_module: str
    launcher: Launcher
    install_hint: str

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec(self.requires_module) is None:
            return f"the {self.requires_module} package is not installed; {self.install_hint}"
        return None


#: ``--multi_gpu`` with N processes also serves CPUs: ``--cpu --num_processes N``
#: starts a single process unless given an MPI hostfile.  The worker asks for
#: the CPU itself (``Accelerator(cpu=...)``).  ``--multi_gpu`` needs N >= 2.
_ACCELERATE = ("accelerate launch --multi_gpu --num_processes {n} --num_machines 1 --mixed_precision no "
               "--dynamo_backend no {opts} ")
ACCELERATE = Launcher(name="accelerate", module=_ACCELERATE + "-m {module}", file=_ACCELERATE + "{file}",
                      local_opts="--main_process_port {port}", local_env={"GLOO_SOCKET_IFNAME": "lo"})
PEERS = {"accelerate": Peer("accelerate", ACCELERATE, "pip install 'parallelx[bench]'")}


def spec(family: str) -> Peer | type[parallelx.Backend]:
    """The backend class of ``family``, or the peer framework's stand-in."""
    return PEERS.get(family) or parallelx.backend_class(family)


def unavailable(family: str) -> str | None:
    """Why ``family`` cannot run here (None when it can), without importing its package."""
    return runner.unavailable(spec(family))


def child_env(threads: int, timeout_s: float) -> dict[str, str]:
    """What every launch adds to :func:`parallelx.runner.job_env`."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            # Every launcher gets the same explicit thread count (torchrun would otherwise force 1,
            # the others leave torch at all cores).
            "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "PARALLELX_TIMEOUT": str(int(timeout_s)),
            "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}  # Accelerate must never reach for the network


def start(launcher: Launcher, target: list[str], nproc: int, log: Path, threads: int,
          timeout_s: float) -> str | None:
    """One launch, its output in ``log``: None when it succeeded, else what went wrong with its log's tail.
    It dies with this process even if that is killed (benchmarks run unattended for long)."""
    done = runner.launch(launcher, target, nproc, timeout=timeout_s, env=child_env(threads, timeout_s), cwd=ROOT,
                         log=log, die_with_parent=True)
    error = done.error()
    return None if error is None else f"{error} (log {log}):\n{done.tail(25)}"


def run_job(job: Job, machine: Machine, work: Path, timeout_s: float) -> None:
    """Launch ``job`` under its backend's launcher; sets ``job.error`` when it failed or wrote no results."""
    impl = IMPLS[job.impl]
    out, plan_file = job.out(work), work / "plans" / f"{job.tag}.json"
    plan_file.parent.mkdir(parents=True, exist_ok=True)
    Plan(impl=job.impl, nproc=job.nproc, threads=job.threads, out=str(out), cases=job.cases,
         bind_cores=machine.bind_cores).dump(plan_file)
    shutil.rmtree(out, ignore_errors=True)  # an earlier run's leftovers in a reused --work-dir would be read as ours
    print(f"[bench] {job.tag}: {' '.join(c.id for c in job.cases)}", flush=True)
    log = work / "logs" / f"{job.tag}.log"
    target = ["-m", impl.module, *impl.args, "--plan", str(plan_file), *job.extra_args]
    begin = time.monotonic()
    job.error = start(spec(impl.family).launcher, target, job.nproc, log, job.threads, timeout_s)
    job.seconds = time.monotonic() - begin
    missing = [c.id for c in job.cases if not result_path(out, job.impl, c, 0).is_file()]
    if job.error is None and missing:
        job.error = f"exited 0 but wrote no results for {', '.join(missing)} (log {log})"
    print(f"[bench] {job.tag}: {'ok' if job.error is None else 'FAILED'} in {job.seconds:.1f}s", flush=True)
    if job.error:
        print(job.error, file=sys.stderr, flush=True)


def on_sigterm(signum: int, frame: object) -> None:
    """Installed by the command lines: unwinds through the runner, which kills the running launch."""
    raise SystemExit(128 + signum)
