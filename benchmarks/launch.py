"""Starting one benchmark launch: the command line from its backend's
:class:`parallelx.launch.Launcher`, the environment every launch shares, a
timeout that kills the whole process group, and the launcher's clean-up."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import parallelx
from benchmarks.plan import IMPLS, Job, Machine
from benchmarks.workload import Plan, result_path
from parallelx.launch import PYTHON, Launcher, free_port

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Peer:
    """A framework compared with parallelx that is not a parallelx backend:
    the part of a backend class's interface that launching needs."""

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
ACCELERATE = Launcher(
    name="accelerate",
    module="accelerate launch --multi_gpu --num_processes {n} --num_machines 1 --mixed_precision no "
           "--dynamo_backend no {opts} -m {module}",
    file="accelerate launch --multi_gpu --num_processes {n} --num_machines 1 --mixed_precision no "
         "--dynamo_backend no {opts} {file}",
    local_opts="--main_process_port {port}",
    local_env={"GLOO_SOCKET_IFNAME": "lo"},
)
PEERS = {"accelerate": Peer("accelerate", ACCELERATE, "pip install 'parallelx[bench]'")}


def runner(family: str) -> Peer | type[parallelx.Backend]:
    """The backend class of ``family``, or the peer framework's stand-in."""
    return PEERS.get(family) or parallelx.backend_class(family)


def unavailable(family: str) -> str | None:
    """Why ``family`` cannot run here (None when it can), without importing its package."""
    spec = runner(family)
    reason = spec.unavailable_reason()
    if reason is None and spec.launcher.program_path() is None:
        hint = f"; {spec.install_hint}" if spec.install_hint else ""
        reason = f"its launcher `{spec.launcher.name}` is not installed{hint}"
    return reason


def child_env(launcher: Launcher, threads: int, timeout_s: float) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        PATH=os.pathsep.join([str(BIN), os.environ.get("PATH", "")]),
        # Every launcher gets the same explicit thread count (torchrun would
        # otherwise force 1, the others leave torch at all cores).
        OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
        PARALLELX_TIMEOUT=str(int(timeout_s)),
        # Accelerate must never reach for the network.
        HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
    )
    env.update(launcher.env())
    return env


def run_logged(cmd: list[str], env: dict[str, str], log_file: Path, timeout_s: float) -> int | None:
    """Run ``cmd`` with its output in ``log_file``; its exit status, or None
    when it ran past ``timeout_s`` and its whole process group was killed."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        # Its own process group, so that a timeout kills the launcher and all its workers.
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_die_with_parent)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return None
        except BaseException:  # Ctrl-C, SIGTERM: take the launch down with us
            _kill_group(proc)
            raise


def failure(rc: int | None, log_file: Path, timeout_s: float) -> str | None:
    if rc == 0:
        return None
    tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-25:])
    what = f"timed out after {timeout_s:.0f}s and was killed" if rc is None else f"exited with status {rc}"
    return f"{what} (log {log_file}):\n{tail}"


def run_job(job: Job, machine: Machine, work: Path, timeout_s: float) -> None:
    """Launch ``job`` under its backend's launcher; sets ``job.error`` when it
    failed or wrote no results."""
    impl = IMPLS[job.impl]
    launcher = runner(impl.family).launcher
    out = job.out(work)
    plan_file = work / "plans" / f"{job.tag}.json"
    plan_file.parent.mkdir(parents=True, exist_ok=True)
    Plan(impl=job.impl, nproc=job.nproc, threads=job.threads, out=str(out), cases=job.cases,
         bind_cores=machine.bind_cores).dump(plan_file)
    port = free_port()
    cmd = launcher.command(["-m", impl.module, *impl.args, "--plan", str(plan_file), *job.extra_args], job.nproc,
                           port=port)
    log_file = work / "logs" / f"{job.tag}.log"
    # Leftovers of an earlier run in a reused --work-dir would be read as this one's.
    shutil.rmtree(out, ignore_errors=True)
    print(f"[bench] {job.tag}: {' '.join(c.id for c in job.cases)}", flush=True)
    start = time.monotonic()
    try:
        rc = run_logged(cmd, child_env(launcher, job.threads, timeout_s), log_file, timeout_s)
    finally:
        if launcher.cleanup is not None:
            launcher.cleanup(port)  # what killed ranks (and some plain scripts) leave behind
    job.seconds = time.monotonic() - start
    job.error = failure(rc, log_file, timeout_s)
    missing = [c.id for c in job.cases if not result_path(out, job.impl, c, 0).is_file()]
    if job.error is None and missing:
        job.error = f"exited 0 but wrote no results for {', '.join(missing)} (log {log_file})"
    print(f"[bench] {job.tag}: {'ok' if job.error is None else 'FAILED'} in {job.seconds:.1f}s", flush=True)
    if job.error:
        print(job.error, file=sys.stderr, flush=True)


def run_loader(work: Path, *, image_size: int, threads: int, batches: int, per_class: int, data_dir: Path | None,
               timeout_s: float) -> dict[str, Any]:
    """``benchmarks.loader_bench`` in one process: its report, or ``{"error": ...}``."""
    out_file = work / "loader.json"
    args = ["--image-size", str(image_size), "--out", str(out_file), "--threads", str(threads), "--batch", "16",
            "--batches", str(batches), "--data-dir", str(data_dir or work / "dogcat")]
    if data_dir is None:
        args += ["--make", str(per_class)]
    cmd = PYTHON.command(["-m", "benchmarks.loader_bench", *args], 1)
    print("[bench] loader: " + shlex.join(cmd[1:]), flush=True)
    log_file = work / "logs" / "loader.log"
    error = failure(run_logged(cmd, child_env(PYTHON, threads, timeout_s), log_file, timeout_s), log_file, timeout_s)
    return {"error": f"loader benchmark {error}"} if error else json.loads(out_file.read_text())


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _die_with_parent() -> None:
    """In the launcher's process: get SIGTERM (which every launcher forwards to
    its workers) if the orchestrator dies, even by SIGKILL (Linux only)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def on_sigterm(signum: int, frame: object) -> None:
    """Installed by the CLI: unwinds through ``run_logged``, which kills the running launch."""
    raise SystemExit(128 + signum)
