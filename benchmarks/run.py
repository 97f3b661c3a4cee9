"""Run the benchmark table: every available backend, through parallelx and
through its plain hand-written script, side by side on one machine.

    python -m benchmarks.run --mode quick            # < 5 minutes on 2 CPU cores
    python -m benchmarks.run --mode full             # real hardware: NCCL, one process per GPU
    python -m benchmarks.run --mode smoke --out-dir /tmp/b   # what the test suite runs
    python -m benchmarks.run --only ddp,scaling --models lenet

Each launch goes through the real launcher (torchrun, horovodrun, the
deepspeed launcher, accelerate launch) with a timeout that kills its whole
process group.  parallelx and plain runs alternate (raw, px, px, raw, ...)
so that a slow spell of a noisy machine hits both alike.  Results go to
``--out-dir`` (default ``benchmarks/results/``): ``results.json``,
``results.md`` and ``results.png``.  The exit status is 1 when a launch
failed or final weights differ between parallelx and the plain script.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import random
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.workload import (MODELS, BenchError, Case, Plan, cpu_cores, exit_on_bench_error, result_path,
                                 weights_path)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results"
BIN = Path(sys.executable).parent
#: Final weights of parallelx and of the plain script must agree this closely
#: (max absolute difference).  The same math in the same order gives exactly
#: 0; a different order of float additions would give ~1e-7.
WEIGHT_ATOL = 1e-6
#: The overhead target of the issue: median step time parallelx / plain.
RATIO_TARGET = 1.02
FAMILIES = ("ddp", "horovod", "deepspeed")
IMPL_LAUNCHERS = {"ddp": "torchrun", "horovod": "horovodrun", "deepspeed": "deepspeed"}
PARTS = (*FAMILIES, "accelerate", "scaling", "same-process", "loader")
#: (measured, baseline): what the overhead and weight tables compare.
PAIRS = ([(f"px-{f}", f"raw-{f}") for f in FAMILIES] + [("accelerate", "raw-ddp")]
         + [(f"ctl-{f}", f"raw-{f}") for f in FAMILIES])


@dataclass(frozen=True, kw_only=True)
class Impl:
    """One way of running the workload: a launcher and a worker module."""

    name: str
    family: str  # the backend it exercises: ddp, horovod, deepspeed, accelerate
    launcher: str
    module: str
    args: tuple[str, ...] = ()
    paired: bool = False  # runs the plain and the parallelx step itself (benchmarks.same_process)


IMPLS: dict[str, Impl] = {i.name: i for i in (
    Impl(name="raw-ddp", family="ddp", launcher="torchrun", module="benchmarks.raw_ddp"),
    Impl(name="px-ddp", family="ddp", launcher="torchrun", module="benchmarks.px_worker", args=("--backend", "ddp")),
    Impl(name="raw-horovod", family="horovod", launcher="horovodrun", module="benchmarks.raw_horovod"),
    Impl(name="px-horovod", family="horovod", launcher="horovodrun", module="benchmarks.px_worker",
         args=("--backend", "horovod")),
    Impl(name="raw-deepspeed", family="deepspeed", launcher="deepspeed", module="benchmarks.raw_deepspeed"),
    Impl(name="px-deepspeed", family="deepspeed", launcher="deepspeed", module="benchmarks.px_worker",
         args=("--backend", "deepspeed")),
    Impl(name="accelerate", family="accelerate", launcher="accelerate", module="benchmarks.raw_accelerate"),
    # --control: each plain script a second time, compared with itself.  No
    # difference exists by construction, so its ratio and interval show what
    # the machine's noise alone makes of a parallelx / plain ratio.
    *(Impl(name=f"ctl-{f}", family=f, launcher=IMPL_LAUNCHERS[f], module=f"benchmarks.raw_{f}")
      for f in ("ddp", "horovod", "deepspeed")),
    *(Impl(name=f"same-{f}", family=f, launcher=IMPL_LAUNCHERS[f], module="benchmarks.same_process",
           args=("--backend", f), paired=True) for f in ("ddp", "horovod", "deepspeed")),
)}


@dataclass(frozen=True, kw_only=True)
class Preset:
    """How much to measure.  Batches are per process (weak scaling)."""

    lenet_batches: tuple[int, ...]  # DDP (and scaling) runs measure each of these
    lenet_batch: int  # the LeNet batch of every other backend
    lenet_warmup: int
    lenet_steps: int
    vgg_batch: int
    vgg_warmup: int
    vgg_steps: int
    image_size: int
    repeats: int  # raw/px alternations (A B B A ...)
    vgg_repeats: int  # of which the first ones include VGG16
    scaling_all: bool  # 1-process runs of every implementation, not only DDP
    scaling_vgg: bool  # 1-process runs include VGG16
    loader_per_class: int  # generated Dogs-vs-Cats images per class
    loader_batches: int  # timed loader batches (of 16 images) per worker setting
    same_blocks: int  # same-process part: alternating blocks of each implementation
    same_steps: int  # ... and timed LeNet steps per block (after 2 untimed)
    timeout_s: float  # per launch


PRESETS: dict[str, Preset] = {
    # Only checks that everything runs; its numbers mean nothing.
    "smoke": Preset(lenet_batches=(32,), lenet_batch=32, lenet_warmup=1, lenet_steps=3, vgg_batch=2,
                    vgg_warmup=0, vgg_steps=1, image_size=32, repeats=1, vgg_repeats=1, scaling_all=False,
                    scaling_vgg=False, loader_per_class=16, loader_batches=3, same_blocks=2, same_steps=2,
                    timeout_s=240),
    # A 2-core CPU machine in under 5 minutes: VGG16 (138 M parameters) is
    # measured for a few steps in the first round only.
    "quick": Preset(lenet_batches=(64, 128, 256), lenet_batch=256, lenet_warmup=3, lenet_steps=30, vgg_batch=4,
                    vgg_warmup=1, vgg_steps=2, image_size=64, repeats=2, vgg_repeats=1, scaling_all=False,
                    scaling_vgg=False, loader_per_class=64, loader_batches=16, same_blocks=10, same_steps=8,
                    timeout_s=240),
    # Real hardware (GPUs: one process each, NCCL).
    "full": Preset(lenet_batches=(64, 128, 256, 512), lenet_batch=256, lenet_warmup=20, lenet_steps=200,
                   vgg_batch=32, vgg_warmup=5, vgg_steps=40, image_size=224, repeats=4, vgg_repeats=2,
                   scaling_all=True, scaling_vgg=True, loader_per_class=500, loader_batches=100, same_blocks=20,
                   same_steps=50, timeout_s=1800),
}


@dataclass(kw_only=True)
class Job:
    impl: str
    nproc: int
    threads: int
    cases: list[Case]
    repeat: int
    extra_args: tuple[str, ...] = ()  # for the worker, after --plan
    seconds: float = 0.0
    error: str | None = None
    log: str = ""

    @property
    def tag(self) -> str:
        return f"{self.impl}-n{self.nproc}-r{self.repeat}"


@dataclass(kw_only=True)
class Machine:
    gpus: int
    gpu_names: list[str]
    cores: int
    nproc: int
    threads_n: int  # torch threads per process when nproc processes share the machine
    threads_1: int  # ... when one process has it alone
    comm: str  # what the process groups use: nccl or gloo
    bind_cores: bool  # each CPU process pinned to its own block of cores


# ------------------------------------------------------------------ launching
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def executable(name: str) -> str | None:
    """A launcher from this interpreter's environment, else from PATH."""
    local = BIN / name
    return str(local) if local.exists() else shutil.which(name)


def unavailable(family: str) -> str | None:
    """Why a family cannot run here (None when it can), without importing it."""
    package, launcher = {"ddp": ("torch", "torchrun"), "horovod": ("horovod", "horovodrun"),
                         "deepspeed": ("deepspeed", "deepspeed"), "accelerate": ("accelerate", "accelerate")}[family]
    if importlib.util.find_spec(package) is None:
        hint = {"horovod": "python scripts/build_horovod.py", "deepspeed": "pip install 'parallelx[deepspeed]'",
                "accelerate": "pip install 'parallelx[bench]'"}.get(family, f"pip install {package}")
        return f"the {package} package is not installed ({hint})"
    if executable(launcher) is None:
        return f"the {launcher} launcher is not on PATH"
    return None


def launch_command(impl: Impl, nproc: int, threads: int, worker_args: list[str], machine: Machine) -> list[str]:
    target = ["-m", impl.module, *impl.args, *worker_args]
    exe = executable(impl.launcher)
    if impl.launcher == "torchrun":
        return [exe, "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                *target]
    if impl.launcher == "horovodrun":
        nic = ["--network-interface", "lo"] if machine.gpus == 0 else []
        return [exe, "-np", str(nproc), "-H", f"localhost:{nproc}", "--gloo", *nic, sys.executable, *target]
    if impl.launcher == "deepspeed":
        # Without GPUs, --num_gpus is the number of CPU processes.
        return [exe, "--num_gpus", str(nproc), "--master_port", str(free_port()), "--module", *target[1:]]
    if impl.launcher == "accelerate":
        multi = ["--multi_gpu"] if nproc > 1 else []
        return [exe, "launch", *multi, "--num_processes", str(nproc), "--num_machines", "1", "--mixed_precision",
                "no", "--dynamo_backend", "no", "--num_cpu_threads_per_process", str(threads),
                "--main_process_port", str(free_port()), *target]
    raise BenchError(f"unknown launcher {impl.launcher!r}")


def child_env(impl: Impl, threads: int, machine: Machine, timeout_s: float) -> dict[str, str]:
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
    if machine.gpus == 0:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        if impl.launcher == "accelerate":
            # `accelerate launch --cpu` starts N processes only through MPI;
            # --multi_gpu plus this variable gives N Gloo processes.
            env["ACCELERATE_USE_CPU"] = "1"
    return env


def run_job(job: Job, machine: Machine, work: Path, timeout_s: float) -> None:
    impl = IMPLS[job.impl]
    out = job_dir(work, job)
    plan_file = work / "plans" / f"{job.tag}.json"
    plan_file.parent.mkdir(parents=True, exist_ok=True)
    Plan(impl=job.impl, nproc=job.nproc, threads=job.threads, out=str(out), cases=job.cases,
         bind_cores=machine.bind_cores).dump(plan_file)
    cmd = launch_command(impl, job.nproc, job.threads, ["--plan", str(plan_file), *job.extra_args], machine)
    log_file = work / "logs" / f"{job.tag}.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    # Leftovers of an earlier run in a reused --work-dir would be read as this one's.
    shutil.rmtree(out, ignore_errors=True)
    print(f"[bench] {job.tag}: {' '.join(c.id for c in job.cases)}", flush=True)
    start = time.monotonic()
    with log_file.open("w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        # Its own process group, so that a timeout kills the launcher and all its workers.
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(impl, job.threads, machine, timeout_s), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc = None
        except BaseException:  # Ctrl-C, SIGTERM: take the launch down with us
            _kill_group(proc)
            raise
        finally:
            if impl.launcher == "deepspeed":
                # Plain DeepSpeed scripts, and killed ranks, leave their /dev/shm buffers behind.
                from backends.deepspeed import remove_shm_buffers

                remove_shm_buffers(cmd[cmd.index("--master_port") + 1])
    job.seconds = time.monotonic() - start
    job.log = str(log_file)
    tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-25:])
    if rc is None:
        job.error = f"timed out after {timeout_s:.0f}s and was killed (log {log_file}):\n{tail}"
    elif rc != 0:
        job.error = f"exited with status {rc} (log {log_file}):\n{tail}"
    else:
        missing = [c.id for c in job.cases if not result_path(out, job.impl, c, 0).is_file()]
        if missing:
            job.error = f"exited 0 but wrote no results for {', '.join(missing)} (log {log_file})"
    status = "ok" if job.error is None else "FAILED"
    print(f"[bench] {job.tag}: {status} in {job.seconds:.1f}s", flush=True)
    if job.error:
        print(job.error, file=sys.stderr, flush=True)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _die_with_parent() -> None:
    """In the launcher's process: get SIGTERM (which every launcher forwards to
    its workers) if this orchestrator dies, even by SIGKILL (Linux only)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _on_sigterm(signum: int, frame: object) -> None:
    # Unwinds through run_job, which kills the running launch's process group.
    raise SystemExit(128 + signum)


# ------------------------------------------------------------------- planning
def lenet(batch: int, p: Preset, save: bool, threads: int | None = None) -> Case:
    return Case(model="lenet", batch=batch, image_size=32, warmup=p.lenet_warmup, steps=p.lenet_steps, lr=0.01,
                save_weights=save, threads=threads)


def vgg(p: Preset, save: bool, threads: int | None = None) -> Case:
    return Case(model="vgg16", batch=p.vgg_batch, image_size=p.image_size, warmup=p.vgg_warmup, steps=p.vgg_steps,
                lr=0.001, save_weights=save, threads=threads)


def schedule(p: Preset, parts: list[str], models: list[str], machine: Machine, control: bool = False,
             same_process: tuple[str, ...] = ()) -> list[Job]:
    """Every launch, in order.  Within a round, each backend's parallelx and
    plain runs are adjacent and their order flips every round (A B, B A);
    with ``control``, the plain script's second run joins them and the three
    rotate (A B C, B C A, C A B).  Last, one same-process launch for each
    backend in ``same_process`` (LeNet: its batches alone give both
    implementations identical weights; VGG16's dropout would not)."""
    jobs: list[Job] = []
    n = machine.nproc
    for r in range(p.repeats):
        save = r == 0  # one set of final weights per implementation is enough
        with_vgg = "vgg16" in models and r < p.vgg_repeats

        # save and with_vgg are bound now: each round's cases use that round's values.
        def cases(family: str, *, one_process: bool = False, save: bool = save,
                  with_vgg: bool = with_vgg) -> list[Case]:
            batches = {*p.lenet_batches, p.lenet_batch} if family == "ddp" or p.scaling_all else {p.lenet_batch}
            # A 1-process run measures two baselines in one launch: all the
            # cores' threads (same hardware as N processes), and the threads
            # each of the N processes gets (same per-process resources).
            variants: list[int | None] = [None]
            if one_process and machine.threads_n != machine.threads_1:
                variants.append(machine.threads_n)
            out = [lenet(b, p, save, t) for b in sorted(batches) for t in variants] if "lenet" in models else []
            if with_vgg and (not one_process or p.scaling_vgg):
                out += [vgg(p, save, t) for t in variants]
            return out

        for family in FAMILIES:
            if family not in parts:
                continue
            group = [f"raw-{family}", f"px-{family}"]
            if control:
                group.append(f"ctl-{family}")
                group = group[r % 3:] + group[:r % 3]
            elif r % 2:
                group.reverse()
            for impl in group:
                jobs.append(Job(impl=impl, nproc=n, threads=machine.threads_n, cases=cases(family), repeat=r))
            if family == "ddp" and "accelerate" in parts:
                jobs.append(Job(impl="accelerate", nproc=n, threads=machine.threads_n, cases=cases("accelerate"),
                                repeat=r))
        if "accelerate" in parts and "ddp" not in parts:
            jobs.append(Job(impl="accelerate", nproc=n, threads=machine.threads_n, cases=cases("accelerate"),
                            repeat=r))
        if "scaling" in parts and n > 1:
            names = ["raw-ddp", "px-ddp"]
            if p.scaling_all:
                names += [i for i in IMPLS if IMPLS[i].family in parts and i not in names and not i.startswith("ctl-")]
            for impl in names if r % 2 == 0 else names[::-1]:
                jobs.append(Job(impl=impl, nproc=1, threads=machine.threads_1,
                                cases=cases(IMPLS[impl].family, one_process=True), repeat=r))
    if "lenet" in models and n > 1:
        for family in same_process:
            case = replace(lenet(p.lenet_batch, p, False), warmup=2, steps=p.same_steps)
            jobs.append(Job(impl=f"same-{family}", nproc=n, threads=machine.threads_n, cases=[case], repeat=0,
                            extra_args=("--blocks", str(p.same_blocks))))
    return [j for j in jobs if j.cases]


# ----------------------------------------------------------------- collecting
def job_dir(work: Path, job: Job) -> Path:
    """Where one launch writes its results (and, in the first round, weights)."""
    return work / "out" / job.tag


def load_rank_reports(job: Job, work: Path, case: Case) -> list[dict[str, Any]]:
    reports = []
    for r in range(job.nproc):
        path = result_path(job_dir(work, job), job.impl, case, r)
        if path.is_file():
            reports.append(json.loads(path.read_text()))
    return reports


def collect(jobs: list[Job], work: Path) -> list[dict[str, Any]]:
    """One row per (implementation, process count, case): step times pooled
    over the repeats, and kept per round for the confidence intervals.  The
    ranks advance in lockstep (each waits for the others in the gradient
    all-reduce, so their summed step times agree), which makes any rank's
    step time the job's; a step's time is the mean over ranks, which evens
    out where each rank's timer happens to cut the shared wait."""
    pooled: dict[tuple[str, int, str], dict[str, Any]] = {}
    for job in jobs:
        if job.error or IMPLS[job.impl].paired:
            continue
        for case in job.cases:
            reports = load_rank_reports(job, work, case)
            if len(reports) != job.nproc:
                continue
            steps = [statistics.fmean(step) for step in zip(*(rep["step_times_s"] for rep in reports))]
            key = (job.impl, job.nproc, case.id)
            row = pooled.setdefault(key, {
                "impl": job.impl, "family": IMPLS[job.impl].family, "nproc": job.nproc,
                "threads": reports[0]["threads"], "case_id": case.id, "model": case.model, "batch": case.batch,
                "base_id": f"{case.model}-{case.image_size}px-b{case.batch}",
                "image_size": case.image_size, "warmup": case.warmup, "steps": case.steps,
                "device": reports[0]["device"], "cores": [rep.get("cores") for rep in reports],
                "rounds": [], "round_step_times_s": [], "repeat_medians_s": [],
                "peak_rss_mib": 0.0, "peak_gpu_mib": None,
                "final_loss": reports[0]["final_loss"], "repeats": 0})
            row["rounds"].append(job.repeat)
            row["round_step_times_s"].append(steps)
            row["repeat_medians_s"].append(statistics.median(steps))
            row["peak_rss_mib"] = max(row["peak_rss_mib"], *(rep["peak_rss_mib"] for rep in reports))
            gpu = [rep["peak_gpu_mib"] for rep in reports if rep["peak_gpu_mib"] is not None]
            if gpu:
                row["peak_gpu_mib"] = max(row["peak_gpu_mib"] or 0.0, *gpu)
            row["repeats"] += 1
    rows = []
    for row in pooled.values():
        pooled = [t for steps in row["round_step_times_s"] for t in steps]
        med = statistics.median(pooled)
        imgs = row["nproc"] * row["batch"]
        row.update(median_step_s=med, p10_step_s=quantile(pooled, 0.1), images_per_s=imgs / med,
                   epoch_s_projected=-(-MODELS[row["model"]]["train_images"] // imgs) * med)
        rows.append(row)
    order = list(IMPLS)
    rows.sort(key=lambda r: (r["model"] != "lenet", r["batch"], -r["nproc"], -r["threads"], order.index(r["impl"])))
    return rows


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank below) of ``values``."""
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def find(rows: list[dict[str, Any]], impl: str, nproc: int, case_id: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["impl"] == impl and r["nproc"] == nproc and r["case_id"] == case_id), None)


def round_interval(a: dict[str, Any], b: dict[str, Any], stat: Callable[[float, float], float], *,
                   resamples: int = 2000, seed: int = 0) -> list[float] | None:
    """95 % bootstrap interval of ``stat(median step of a, median step of b)``
    over the rounds: the rounds both rows ran in are drawn with replacement,
    each taking its step times of ``a`` and of ``b`` together, because the
    machine's state changes from launch to launch far more than from step to
    step.  None with fewer than 3 common rounds."""
    ta, tb = dict(zip(a["rounds"], a["round_step_times_s"])), dict(zip(b["rounds"], b["round_step_times_s"]))
    common = sorted(ta.keys() & tb.keys())
    if len(common) < 3:
        return None
    rng = random.Random(seed)
    values = []
    for _ in range(resamples):
        pick = rng.choices(common, k=len(common))
        values.append(stat(statistics.median([t for r in pick for t in ta[r]]),
                           statistics.median([t for r in pick for t in tb[r]])))
    values.sort()
    return [values[int(0.025 * (resamples - 1))], values[int(0.975 * (resamples - 1))]]


def overheads(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median step time of parallelx (and of Accelerate) over the plain
    script's; also the ratio of the 10th percentiles, which a noisy machine
    disturbs less (interference only ever adds time to a step)."""
    out = []
    for a, b in PAIRS:
        for row in rows:
            if row["impl"] != a:
                continue
            ref = find(rows, b, row["nproc"], row["case_id"])
            if ref is None:
                continue
            ref_medians = dict(zip(ref["rounds"], ref["repeat_medians_s"]))
            per_repeat = [x / ref_medians[r] for r, x in zip(row["rounds"], row["repeat_medians_s"])
                          if r in ref_medians]
            ratio = row["median_step_s"] / ref["median_step_s"]
            out.append({"impl": a, "baseline": b, "case_id": row["case_id"], "nproc": row["nproc"],
                        "median_step_s": row["median_step_s"], "baseline_median_step_s": ref["median_step_s"],
                        "ratio": ratio, "ratio_p10": row["p10_step_s"] / ref["p10_step_s"],
                        "repeat_ratios": per_repeat, "ci95": round_interval(row, ref, lambda x, y: x / y),
                        "within_target": ratio <= RATIO_TARGET if a.startswith("px-") else None})
    return out


def same_process(jobs: list[Job], work: Path) -> list[dict[str, Any]]:
    """The same-process launches: parallelx / plain median step time over all
    blocks, with per-block ratios and a 95 % interval over the blocks (block
    i of each implementation ran back to back), and the two models' final
    weights.  As elsewhere, a step's time is the mean over the lockstep ranks."""
    out = []
    for job in jobs:
        if job.error or not IMPLS[job.impl].paired:
            continue
        for case in job.cases:
            reports = load_rank_reports(job, work, case)
            if len(reports) != job.nproc:
                continue
            rows = {}
            for name in ("plain", "parallelx"):
                blocks = [[statistics.fmean(step) for step in zip(*per_rank)]
                          for per_rank in zip(*(rep["blocks"][name] for rep in reports))]
                rows[name] = {"rounds": list(range(len(blocks))), "round_step_times_s": blocks,
                              "median_step_s": statistics.median([t for b in blocks for t in b])}
            px, plain = rows["parallelx"], rows["plain"]
            diff = max(rep["max_abs_weight_diff"] for rep in reports)
            out.append({
                "impl": job.impl, "family": IMPLS[job.impl].family, "case_id": case.id, "nproc": job.nproc,
                "threads": reports[0]["threads"], "blocks": len(px["rounds"]), "steps_per_block": case.steps,
                "median_step_s": px["median_step_s"], "baseline_median_step_s": plain["median_step_s"],
                "ratio": px["median_step_s"] / plain["median_step_s"],
                "block_ratios": [statistics.median(a) / statistics.median(b)
                                 for a, b in zip(px["round_step_times_s"], plain["round_step_times_s"])],
                "ci95": round_interval(px, plain, lambda x, y: x / y),
                "max_abs_weight_diff": diff, "weights_passed": diff <= WEIGHT_ATOL,
                "within_target": px["median_step_s"] / plain["median_step_s"] <= RATIO_TARGET})
    return out


def compare_weights(jobs: list[Job], work: Path) -> list[dict[str, Any]]:
    """Final weights after warmup + steps: parallelx against the plain script
    of its backend (and Accelerate against plain DDP), same process count."""
    import torch

    out = []
    first = {(j.impl, j.nproc): j for j in jobs if j.repeat == 0 and not j.error}
    for a, b in PAIRS:
        for nproc in sorted({j.nproc for j in jobs}, reverse=True):
            ja, jb = first.get((a, nproc)), first.get((b, nproc))
            if ja is None or jb is None:
                continue
            for case in ja.cases:
                fa, fb = weights_path(job_dir(work, ja), a, case), weights_path(job_dir(work, jb), b, case)
                if not (fa.is_file() and fb.is_file()):
                    continue
                wa = torch.load(fa, map_location="cpu", weights_only=True)
                wb = torch.load(fb, map_location="cpu", weights_only=True)
                if wa.keys() != wb.keys() or any(wa[k].shape != wb[k].shape for k in wa):
                    diff = rel = float("inf")
                else:
                    diffs = {k: float((wa[k].float() - wb[k].float()).abs().max()) if wa[k].numel() else 0.0
                             for k in wa}
                    diff = max(diffs.values())
                    rel = max(d / max(float(wb[k].float().abs().max()), 1e-12) for k, d in diffs.items())
                finite = all(bool(torch.isfinite(v).all()) for v in wa.values() if v.is_floating_point())
                out.append({"impl": a, "baseline": b, "case_id": case.id, "nproc": nproc, "max_abs_diff": diff,
                            "max_rel_diff": rel, "identical": diff == 0.0, "tolerance": WEIGHT_ATOL,
                            "finite": finite, "passed": finite and diff <= WEIGHT_ATOL})
    return out


def scaling(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """images/s with N processes over images/s with 1, for every
    implementation that has 1-process runs of the same work: against one
    process using all the cores' threads, and against one process with the
    threads each of the N processes has."""
    out = []
    for row in rows:
        if row["nproc"] == 1:
            continue
        ones = [r for r in rows if r["impl"] == row["impl"] and r["nproc"] == 1 and r["base_id"] == row["base_id"]]
        all_cores = next((r for r in ones if r["case_id"] == r["base_id"]), None)
        same = next((r for r in ones if r["threads"] == row["threads"]), None)
        if all_cores is None and same is None:
            continue
        entry = {"impl": row["impl"], "case_id": row["base_id"], "model": row["model"], "batch": row["batch"],
                 "nproc": row["nproc"], "threads_n": row["threads"], "images_per_s_n": row["images_per_s"]}
        for key, one in (("all_cores", all_cores), ("same_threads", same)):
            if one is not None:
                speedup = row["images_per_s"] / one["images_per_s"]
                # speedup = (n * batch / step_n) / (batch / step_1)
                ci = round_interval(row, one, lambda step_n, step_1, n=row["nproc"]: n * step_1 / step_n)
                entry[key] = {"threads_1": one["threads"], "images_per_s_1": one["images_per_s"],
                              "speedup": speedup, "efficiency": speedup / row["nproc"], "ci95": ci}
        out.append(entry)
    return out


def loader_report(p: Preset, machine: Machine, work: Path, rows: list[dict[str, Any]], image_size: int,
                  data_dir: Path | None, timeout_s: float) -> dict[str, Any]:
    out_file = work / "loader.json"
    cmd = [sys.executable, "-m", "benchmarks.loader_bench", "--image-size", str(image_size),
           "--out", str(out_file), "--threads", str(machine.threads_n), "--batch", "16",
           "--batches", str(p.loader_batches)]
    if data_dir is None:
        cmd += ["--data-dir", str(work / "dogcat"), "--make", str(p.loader_per_class)]
    else:
        cmd += ["--data-dir", str(data_dir)]
    print("[bench] loader: " + shlex.join(cmd[1:]), flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    try:
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"loader benchmark timed out after {timeout_s:.0f}s"}
    if res.returncode != 0:
        return {"error": f"loader benchmark exited {res.returncode}: {(res.stderr or res.stdout)[-2000:]}"}
    report = json.loads(out_file.read_text())
    model = [r for r in rows if r["model"] == "vgg16" and r["image_size"] == image_size and r["nproc"] == machine.nproc]
    per_worker = next((r["images_per_s"] for r in report["results"] if r["workers"] == 1), None)
    report["model"] = [{"impl": r["impl"], "nproc": r["nproc"], "images_per_s": r["images_per_s"],
                        "images_per_s_per_process": r["images_per_s"] / r["nproc"]} for r in model]
    if per_worker and model:
        need = max(m["images_per_s_per_process"] for m in report["model"])
        report["loader_over_model"] = per_worker / need
        report["bottleneck"] = per_worker < need
    return report


# -------------------------------------------------------------------- machine
def detect_machine(nproc: int | None, bind_cores: bool = True) -> Machine:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = [torch.cuda.get_device_name(i) for i in range(gpus)]
    cores = cpu_cores()
    n = nproc or (gpus if gpus >= 1 else 2)
    if gpus and n > gpus:
        raise BenchError(f"--nproc {n} is more than the {gpus} visible GPUs; use --nproc {gpus} or fewer")
    if n < 1:
        raise BenchError(f"--nproc must be >= 1, got {n}")
    # Pinning is for CPU runs only: on GPUs the cores' layout (NUMA) is the launcher's business.
    return Machine(gpus=gpus, gpu_names=names, cores=cores, nproc=n, threads_n=max(1, cores // n),
                   threads_1=max(1, cores), comm="nccl" if gpus else "gloo",
                   bind_cores=bind_cores and gpus == 0 and hasattr(os, "sched_setaffinity"))


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in ("torch", "torchvision", "deepspeed", "horovod", "accelerate", "parallelx"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def hardware(machine: Machine) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        mem = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    return {"arch": platform.machine(), "cpu": cpu, "cores": machine.cores, "memory_gib": mem,
            "gpus": machine.gpu_names, "os": platform.platform()}


# ----------------------------------------------------------------------- main
def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=sorted(PRESETS), default="quick")
    p.add_argument("--only", default=",".join(PARTS),
                   help=f"comma-separated parts to run (default: all of {','.join(PARTS)})")
    p.add_argument("--models", default="lenet,vgg16", help="comma-separated: lenet, vgg16")
    p.add_argument("--image-size", type=int, default=None, help="VGG16 / loader image size (default: the mode's)")
    p.add_argument("--nproc", type=int, default=None, help="processes per run (default: the GPU count, else 2)")
    p.add_argument("--repeats", type=positive_int, default=None,
                   help="raw/parallelx alternations (default: the mode's)")
    p.add_argument("--control", action="store_true",
                   help="also run each plain script a second time and compare it with itself: the noise floor")
    p.add_argument("--blocks", type=positive_int, default=None,
                   help="same-process part: alternating blocks of each implementation (default: the mode's)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="timed LeNet steps per launch (default: the mode's)")
    p.add_argument("--no-bind", dest="bind_cores", action="store_false",
                   help="leave the CPU processes unpinned (default: each on its own cores, the same for every "
                        "implementation)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per launch before it is killed")
    p.add_argument("--dogcat-dir", type=Path, default=None,
                   help="a real Dogs-vs-Cats folder for the loader benchmark (default: generated images)")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    p.add_argument("--work-dir", type=Path, default=None, help="logs, plans and weights (default: a temp dir)")
    p.add_argument("--keep-work", action="store_true", help="keep the work dir (logs, final weights)")
    args = p.parse_args(argv)
    args.parts = [x for x in args.only.split(",") if x]
    bad = [x for x in args.parts if x not in PARTS]
    if bad:
        p.error(f"--only: unknown part(s) {', '.join(bad)}; choose from {', '.join(PARTS)}")
    args.model_list = [x for x in args.models.split(",") if x]
    bad = [x for x in args.model_list if x not in ("lenet", "vgg16")]
    if bad:
        p.error(f"--models: unknown model(s) {', '.join(bad)}; choose from lenet, vgg16")
    return args


@exit_on_bench_error
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    started = time.time()
    load_start = os.getloadavg()
    preset = PRESETS[args.mode]
    overrides: dict[str, Any] = {}
    if args.image_size is not None:
        overrides["image_size"] = args.image_size
    for option, field in (("repeats", "repeats"), ("blocks", "same_blocks"), ("steps", "lenet_steps")):
        if getattr(args, option) is not None:
            overrides[field] = getattr(args, option)
    if args.timeout is not None:
        overrides["timeout_s"] = args.timeout
    preset = replace(preset, **overrides)
    if preset.image_size < 32:
        raise BenchError(f"--image-size {preset.image_size} is too small for VGG16; use at least 32")
    machine = detect_machine(args.nproc, bind_cores=args.bind_cores)
    if machine.gpus == 0 and machine.nproc > machine.cores:
        print(f"[bench] warning: {machine.nproc} processes on {machine.cores} core(s) oversubscribe the CPU",
              file=sys.stderr)

    skipped: dict[str, str] = {}
    parts = []
    for part in args.parts:
        reason = unavailable(part) if part in (*FAMILIES, "accelerate") else None
        if reason:
            skipped[part] = reason
            print(f"[bench] skipping {part}: {reason}", file=sys.stderr)
        else:
            parts.append(part)

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="parallelx-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"[bench] mode {args.mode}: {machine.nproc} processes x {machine.threads_n} thread(s) "
          f"(1-process runs: {machine.threads_1}), {machine.comm}, "
          f"{'pinned to cores' if machine.bind_cores else 'not pinned'}; work dir {work}", flush=True)
    # The same-process part needs each backend's package and launcher, whether or not its own part runs.
    same = tuple(f for f in FAMILIES if unavailable(f) is None) if "same-process" in parts else ()
    jobs = schedule(preset, parts, args.model_list, machine, control=args.control, same_process=same)
    try:
        for job in jobs:
            run_job(job, machine, work, preset.timeout_s)
        rows = collect(jobs, work)
        weights = compare_weights(jobs, work)
        paired = same_process(jobs, work)
        loader = (loader_report(preset, machine, work, rows, preset.image_size, args.dogcat_dir, preset.timeout_s)
                  if "loader" in parts else None)
    finally:
        if not args.keep_work:
            # Final weights are large (VGG16: 0.5 GB per run); logs are not.
            for path in (work / "out").glob("*/*.weights.pt"):
                path.unlink()

    failures = [{"job": j.tag, "error": j.error} for j in jobs if j.error]
    if loader and "error" in loader:
        failures.append({"job": "loader", "error": loader["error"]})
    if args.work_dir is None and not args.keep_work:
        if failures:
            print(f"[bench] keeping the logs of the failed run in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    result = {
        "meta": {
            "command": "python -m benchmarks.run " + shlex.join(argv if argv is not None else sys.argv[1:]),
            "mode": args.mode, "preset": asdict(preset), "parts": parts, "control": args.control,
            "models": args.model_list,
            "skipped": skipped, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
            "wall_s": time.time() - started, "load_average_start": load_start, "load_average_end": os.getloadavg(),
            "hardware": hardware(machine), "versions": versions(), "machine": asdict(machine),
            "weight_tolerance": WEIGHT_ATOL, "ratio_target": RATIO_TARGET,
            "launches": [{"job": j.tag, "seconds": round(j.seconds, 1), "ok": j.error is None} for j in jobs],
        },
        "runs": rows,
        "overhead": overheads(rows),
        "weights": weights,
        "same_process": paired,
        "scaling": scaling(rows),
        "loader": loader,
        "failures": failures,
    }
    from benchmarks.report import write_all

    paths = write_all(result, args.out_dir)
    print(f"[bench] done in {result['meta']['wall_s']:.0f}s: " + ", ".join(str(p) for p in paths), flush=True)
    bad_weights = [w for w in weights if not w["passed"]]
    for w in bad_weights:
        print(f"[bench] WEIGHTS DIFFER: {w['impl']} vs {w['baseline']} on {w['case_id']} (n={w['nproc']}): "
              f"max |diff| {w['max_abs_diff']:.3g} > {WEIGHT_ATOL}", file=sys.stderr)
    for s in paired:
        if not s["weights_passed"]:
            bad_weights.append(s)
            print(f"[bench] WEIGHTS DIFFER in {s['impl']} on {s['case_id']}: plain and parallelx models, "
                  f"max |diff| {s['max_abs_weight_diff']:.3g} > {WEIGHT_ATOL}", file=sys.stderr)
    return 1 if failures or bad_weights else 0


if __name__ == "__main__":
    sys.exit(main())
