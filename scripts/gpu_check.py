"""The GPU check: parallelx's paths that only run on CUDA, checked in one command.

On a GPU machine, from the repository root (``scripts/gpu_check.sh`` first
installs the wheels that ``scripts/gpu_wheels.py`` put in ``gpu-wheels/``)::

    bash scripts/gpu_check.sh                            # 8 minutes at most; report in $OUT or gpu-report/

On a CPU machine (CI runs this, so that the check cannot rot): everything
except what needs CUDA, which the report lists as skipped, with the reason::

    .venv/bin/python scripts/gpu_check.py --dry-run --out /tmp/gpu-report

What it checks, one process per GPU (two processes on the CPU):

- **environment**: versions (torch, CUDA, NCCL, cuDNN, the GPUs), ``python -m
  parallelx env``, and whether the installed parallelx is this checkout;
- **recipes**: CIFAR-10 LeNet and Dogs-vs-Cats VGG16 on ``single``, ``dp``,
  ``ddp`` (torchrun, NCCL), ``deepspeed`` and ``horovod`` (once built), each
  under its own launcher; the val figures reported in ``metrics.json`` must
  equal a single-process evaluation of ``best.pth``;
- **throughput**: Dogs-vs-Cats VGG16 at 224 px, 32 images per process,
  parallelx's DDP step against the plain DDP script's in the same processes
  (``benchmarks/same_process.py``), per precision in :data:`PRECISIONS`;
- **host-sync**: the recipes' training loop (``recipes.engine.run_epoch``)
  under ``torch.cuda.set_sync_debug_mode("warn")``: synchronisations with the
  host per step, against the plain framework's loop on the same loader, and
  the two loops' step times;
- **install**: what ``gpu_check.sh`` installed, and Horovod built from its
  sdist with NCCL operations, in the background while the rest runs; its
  checks run if the build finishes in time, else they are skipped.

Every step has a timeout and the whole run a deadline; a failed step is
recorded and the others still run.  ``report.md`` and ``summary.json`` are
rewritten after every step, so a run cut short still leaves its report.  The
exit status is 0 when every check that ran passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib
import importlib.util
import io
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: The whole check, from the start of gpu_check.sh: the GPU machine gives 10
#: minutes a command, so 8 leave room for its start and the transfers.
BUDGET_S = 480.0
#: Kept free at the end for writing the report.
RESERVE_S = 10.0
PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
SECTIONS = ("install", "environment", "recipes", "throughput", "host-sync")
#: Sections whose figures the Markdown report shows beside each check.
FIGURE_SECTIONS = ("throughput", "host-sync")
#: Every backend the recipes run on; the in-process ones (single, dp) start one process.
BACKENDS = ("single", "dp", "ddp", "deepspeed", "horovod")
#: The backend options each recipe run adds (DeepSpeed: ZeRO-2 shards gradients and optimizer state).
BACKEND_ARGS: dict[str, tuple[str, ...]] = {"deepspeed": ("--zero-stage", "2")}
#: Backends whose training loop the host-sync section measures.
SYNC_BACKENDS = ("single", "ddp", "deepspeed", "horovod")
#: Precisions the throughput section measures: the same-process worker's
#: extra arguments for each, or None while parallelx has no such option (the
#: report then says so).  Adding bf16 once parallelx has it is this one line.
PRECISIONS: dict[str, tuple[str, ...] | None] = {
    "fp32": (),
    "bf16-mixed": None,
}
#: The parallelx step may synchronise with the host this many times per step
#: more than the plain framework's: 0.1 is expected (the progress bar reads
#: the loss every 10th step on the main rank); once per step would be 1.
SYNC_EXCESS_LIMIT = 0.5
HOROVOD_CHECKS_S = 100.0  # what the Horovod recipes and loop need once it is built


# ----------------------------------------------------------------- settings

@dataclass(frozen=True, kw_only=True)
class Settings:
    """How much each part runs: on CUDA, and in the CPU dry run (which CI runs: about 1.5 minutes on 2 cores)."""

    cuda: bool
    cifar_train: int
    cifar_test: int  # odd: two ranks must pad their shards
    dogcat_per_class: int
    cifar_args: tuple[str, ...]
    dogcat_args: tuple[str, ...]
    dogcat_size: int
    #: Backends each recipe runs on; the others are listed as skipped, with ``fewer_because``.
    recipe_backends: dict[str, tuple[str, ...]]
    fewer_because: str
    #: The reported val loss against best.pth's: on the CPU the same float
    #: arithmetic in another order; on GPUs cuDNN may also choose other
    #: kernels for other batch splits.
    loss_rtol: float
    launch_timeout_s: float
    model: str  # throughput: workload model, image size, batch per process, steps per block, blocks
    image_size: int
    batch: int
    warmup: int
    steps: int
    blocks: int
    sync_batch: int
    sync_steps: tuple[int, int, int]  # warm-up, short, long: per-step figures are (long - short) differences
    sync_workers: int
    sync_backends: tuple[str, ...]


CUDA = Settings(cuda=True, cifar_train=2000, cifar_test=501, dogcat_per_class=20,
                cifar_args=("--batch-size", "64"),
                dogcat_args=("--image-size", "224", "--batch-size", "8", "--max-steps", "3", "--lr", "0.001"),
                dogcat_size=224, recipe_backends={"cifar10": BACKENDS, "dogcat": BACKENDS}, fewer_because="",
                loss_rtol=1e-4, launch_timeout_s=180,
                model="vgg16", image_size=224, batch=32, warmup=2, steps=10, blocks=6,
                sync_batch=256, sync_steps=(5, 10, 60), sync_workers=4, sync_backends=SYNC_BACKENDS)
DRY_RUN = Settings(cuda=False, cifar_train=300, cifar_test=51, dogcat_per_class=13,
                   cifar_args=("--batch-size", "32"),
                   dogcat_args=("--image-size", "32", "--batch-size", "4", "--max-steps", "2", "--lr", "0.001"),
                   dogcat_size=32, loss_rtol=1e-5, launch_timeout_s=150,
                   # Near a minute and a half on 2 cores: dp is single on the CPU (no GPUs to split over),
                   # and VGG16 goes through one launch; every backend runs both recipes in the tests.
                   recipe_backends={"cifar10": ("single", "ddp", "deepspeed", "horovod"), "dogcat": ("single",)},
                   fewer_because="dry run: on the CPU dp runs as single, and VGG16 runs on one backend only, "
                                 "to keep the dry run short (tests/test_recipes.py runs them all)",
                   model="lenet", image_size=32, batch=32, warmup=1, steps=3, blocks=2,
                   sync_batch=32, sync_steps=(1, 2, 6), sync_workers=0, sync_backends=("ddp",))


# ------------------------------------------------------------- the report

@dataclass
class Item:
    """One check: what ran, how it ended, and why."""

    section: str
    name: str
    status: str
    detail: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    needs: str | None = None  # "cuda" for what only a GPU machine can check
    log: str | None = None  # the end of a failed step's output


class Skip(Exception):
    """A step that did not run; the message says why."""


class Fail(Exception):
    """A step whose check failed; the message says what was expected."""

    def __init__(self, message: str, *, log: str | None = None, figures: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.log = log
        self.figures = figures or {}


@dataclass
class Outcome:
    detail: str
    figures: dict[str, Any] = field(default_factory=dict)


class Check:
    """Runs steps against a deadline and keeps the report up to date."""

    def __init__(self, out: Path, work: Path, deadline: float, settings: Settings, nproc: int,
                 only: Sequence[str] = SECTIONS) -> None:
        self.out, self.work, self.deadline, self.settings, self.nproc = out, work, deadline, settings, nproc
        self.only = set(only)
        self.items: list[Item] = []
        self.env_text = ""
        self.facts: dict[str, Any] = {}
        self.started = time.time()

    def remaining(self) -> float:
        return self.deadline - time.time()

    def timeout(self, cap: float) -> float:
        """A step's timeout: its own cap, or what is left of the budget."""
        return max(1.0, min(cap, self.remaining() - RESERVE_S))

    def record(self, item: Item) -> Item:
        self.items.append(item)
        line = f"[gpu-check] {item.section} / {item.name}: {item.status} in {item.seconds:.1f}s"
        print(line + (f"  ({item.detail})" if item.detail else ""), flush=True)
        self.write()
        return item

    def skip(self, section: str, name: str, reason: str, *, needs: str | None = None) -> Item:
        return self.record(Item(section, name, SKIPPED, reason, needs=needs))

    def step(self, section: str, name: str, fn: Callable[[], Outcome], *, need_s: float = 0.0,
             needs: str | None = None) -> Item:
        """Run ``fn`` as one check; it returns an :class:`Outcome`, or raises
        :class:`Skip` or :class:`Fail`.  Any other exception fails the step
        with its traceback in the log."""
        if section not in self.only:
            return self.skip(section, name, "not selected (--only)", needs=needs)
        left = self.remaining() - RESERVE_S
        if left < need_s:
            return self.skip(section, name, f"out of time: {max(0, left):.0f}s of the budget left, "
                                            f"this step needs about {need_s:.0f}s", needs=needs)
        start = time.monotonic()
        item = Item(section, name, PASSED, needs=needs)
        try:
            outcome = fn()
            item.detail, item.figures = outcome.detail, outcome.figures
        except Skip as exc:
            item.status, item.detail = SKIPPED, str(exc)
        except Fail as exc:
            item.status, item.detail, item.log, item.figures = FAILED, str(exc), exc.log, exc.figures
        except Exception as exc:  # a broken step must not stop the others
            item.status, item.detail = FAILED, f"{type(exc).__name__}: {exc}"
            item.log = traceback.format_exc()
        item.seconds = time.monotonic() - start
        return self.record(item)

    # ------------------------------------------------------------ writing

    def summary(self) -> dict[str, Any]:
        sections = {}
        for name in SECTIONS:
            items = [i for i in self.items if i.section == name]
            sections[name] = {"status": section_status(items),
                              "items": [{k: v for k, v in asdict(i).items() if k not in ("section", "log")}
                                        for i in items]}
        counts = {s: sum(i.status == s for i in self.items) for s in (PASSED, FAILED, SKIPPED)}
        return {"result": FAILED if counts[FAILED] else PASSED, "mode": "cuda" if self.settings.cuda else "dry-run",
                "nproc": self.nproc, "counts": counts, "seconds": round(time.time() - self.started, 1),
                "started": dt.datetime.fromtimestamp(self.started, dt.timezone.utc).isoformat(timespec="seconds"),
                "environment": self.facts, "logs": str(self.work / "logs"), "sections": sections,
                "skipped_cuda_only": [f"{i.section} / {i.name}" for i in self.items
                                      if i.status == SKIPPED and i.needs == "cuda"]}

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        summary = self.summary()
        _write_atomic(self.out / "summary.json", json.dumps(summary, indent=1, default=str) + "\n")
        _write_atomic(self.out / "report.md", render_markdown(summary, self.items, self.env_text))


def section_status(items: Sequence[Item]) -> str:
    if any(i.status == FAILED for i in items):
        return FAILED
    return PASSED if any(i.status == PASSED for i in items) else SKIPPED


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list) and value and all(isinstance(v, float) for v in value):
        return "[" + ", ".join(f"{v:.4g}" for v in value) + "]"
    return str(value)


def render_markdown(summary: dict[str, Any], items: Sequence[Item], env_text: str) -> str:
    counts = summary["counts"]
    env = summary["environment"]
    where = env.get("gpus") or "CPU only"
    lines = [
        "# parallelx GPU check", "",
        f"**Result: {summary['result'].upper()}**: {counts[PASSED]} passed, {counts[FAILED]} failed, "
        f"{counts[SKIPPED]} skipped, in {summary['seconds']:.0f} s (started {summary['started']}).", "",
        f"Mode: {'CUDA' if summary['mode'] == 'cuda' else 'dry run on the CPU (what needs CUDA is skipped)'}; "
        f"{summary['nproc']} process(es) per multi-process launch; {where}.", "",
        "| section | status | passed | failed | skipped |", "|---|---|---:|---:|---:|",
    ]
    for name, sec in summary["sections"].items():
        n = {s: sum(i["status"] == s for i in sec["items"]) for s in (PASSED, FAILED, SKIPPED)}
        lines.append(f"| {name} | {sec['status']} | {n[PASSED]} | {n[FAILED]} | {n[SKIPPED]} |")
    for name in SECTIONS:
        sec_items = [i for i in items if i.section == name]
        lines += ["", f"## {name}", ""]
        if not sec_items:
            lines.append("Nothing ran in this section.")
            continue
        lines += ["| check | status | s | details |", "|---|---|---:|---|"]
        for i in sec_items:
            # The recipes' figures are in their details already; summary.json has them all.
            figures = ("; ".join(f"{k} {_fmt(v)}" for k, v in i.figures.items() if not isinstance(v, dict))
                       if name in FIGURE_SECTIONS else "")
            detail = " ".join(filter(None, [i.detail, f"({figures})" if figures else ""])).replace("|", "\\|")
            lines.append(f"| {i.name} | {i.status.upper() if i.status == FAILED else i.status} | "
                         f"{i.seconds:.1f} | {detail} |")
        if name == "environment" and env_text:
            lines += ["", "`python -m parallelx env`:", "", "```", env_text.rstrip(), "```"]
        for i in sec_items:
            if i.status == FAILED and i.log:
                lines += ["", f"Output of the failed check *{i.name}* (last lines):", "", "```",
                          _tail(i.log, 40), "```"]
    lines += ["", f"Every launch's whole output: `logs.tar.gz` beside this report when run through "
              f"gpu_check.sh, else `{summary['logs']}`.", "",
              "Environment:", "", "```", json.dumps(env, indent=1, default=str), "```", ""]
    return "\n".join(lines)


def _tail(text: str, n: int) -> str:
    # tqdm redraws with carriage returns: keep the last state of each line.
    rows = [line.rsplit("\r", 1)[-1] for line in text.splitlines()]
    return "\n".join(rows[-n:])


# ------------------------------------------------------------ launching

@dataclass
class Launched:
    rc: int | None  # None: killed at its timeout
    log: Path
    seconds: float
    timeout_s: float

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.is_file() else ""

    def error(self) -> str | None:
        if self.rc == 0:
            return None
        if self.rc is None:
            return f"timed out after {self.timeout_s:.0f}s and was killed"
        return f"exited with status {self.rc}"


class Runner:
    """Starts launches the way a user would: each backend's own launcher, from
    a folder outside the checkout (so the installed parallelx is the one that
    runs), with ``benchmarks`` and the top-level ``recipes`` package reachable
    through a folder of links on ``PYTHONPATH`` (the checkout's root itself on
    the path would shadow the installed parallelx)."""

    def __init__(self, work: Path, settings: Settings) -> None:
        self.work, self.settings = work, settings
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.pythonpath = make_import_links(work / "pythonpath")

    def env(self, launcher: Any, timeout_s: float) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1",
            # A stalled rank fails its collectives before the launch's own timeout.
            PARALLELX_TIMEOUT=str(int(max(30, min(120, timeout_s - 10)))),
            PYTHONPATH=os.pathsep.join(filter(None, [str(self.pythonpath), os.environ.get("PYTHONPATH")])),
            PATH=os.pathsep.join(filter(None, [str(Path(sys.executable).parent), os.environ.get("PATH")])),
        )
        if self.settings.cuda:
            # One machine: NCCL's bootstrap stays on the loopback interface, as Gloo's does.
            env.setdefault("NCCL_SOCKET_IFNAME", "lo")
            nccl = nccl_dirs()
            if nccl is not None:
                env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(nccl[1]), env.get("LD_LIBRARY_PATH")]))
        elif _cuda_visible():
            env["CUDA_VISIBLE_DEVICES"] = ""  # a dry run on a GPU machine stays on the CPU
        env.update(launcher.env())
        return env

    def launch(self, backend: str, target: list[str], n: int, *, timeout_s: float, log_name: str) -> Launched:
        import parallelx
        from parallelx.launch import free_port

        spec = parallelx.backend_class(backend).launcher
        port = free_port()
        cmd = spec.command(target, n if spec.multi_process else 1, port=port)
        log = self.logs / f"{log_name}.log"
        start = time.monotonic()
        try:
            rc = run_logged(cmd, self.env(spec, timeout_s), log, timeout_s, cwd=self.work)
        finally:
            if spec.cleanup is not None:
                spec.cleanup(port)  # what a killed rank leaves behind (DeepSpeed's /dev/shm buffers)
        return Launched(rc, log, time.monotonic() - start, timeout_s)


def make_import_links(folder: Path) -> Path:
    """A folder holding only links to the checkout's ``benchmarks`` and
    ``recipes`` packages, for ``PYTHONPATH``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("benchmarks", "recipes"):
        link = folder / name
        if not link.exists():
            link.symlink_to(ROOT / name, target_is_directory=True)
    return folder


def run_logged(cmd: list[str], env: dict[str, str], log_file: Path, timeout_s: float, *, cwd: Path) -> int | None:
    """Run ``cmd`` in its own process group with its output in ``log_file``;
    its exit status, or None when it ran past ``timeout_s`` and the whole
    group was killed (a hung collective must not hang the check)."""
    with log_file.open("w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return None
        except BaseException:  # SIGTERM from gpu_check.sh's timeout, Ctrl-C: take the launch down too
            _kill_group(proc)
            raise


def _kill_group(proc: subprocess.Popen[Any]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def nccl_dirs() -> tuple[Path, Path] | None:
    """(include, lib) of the NCCL that torch's wheel brings (``nvidia-nccl-*``), if any."""
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except ModuleNotFoundError:
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    base = Path(list(spec.submodule_search_locations)[0])
    if (base / "include" / "nccl.h").is_file() and any((base / "lib").glob("libnccl.so*")):
        return base / "include", base / "lib"
    return None


def unavailable(backend: str) -> str | None:
    """Why ``backend`` cannot run here (None when it can), without importing its package."""
    import parallelx

    importlib.invalidate_caches()  # Horovod may have been installed since the last look
    cls = parallelx.backend_class(backend)
    reason = cls.unavailable_reason()
    if reason is None and cls.launcher.program_path() is None:
        reason = f"its launcher `{cls.launcher.name}` is not installed; {cls.install_hint}"
    return reason


# ------------------------------------------------------------ the steps

class GpuCheck(Check):
    def __init__(self, args: argparse.Namespace, settings: Settings, nproc: int) -> None:
        out = Path(args.out)
        work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpu-check-"))
        work.mkdir(parents=True, exist_ok=True)
        super().__init__(out, work.resolve(), args.deadline or time.time() + BUDGET_S, settings, nproc,
                         only=args.only)
        self.args = args
        self.runner = Runner(self.work, settings)
        self.data = self.work / "data"
        self.horovod_build: subprocess.Popen[Any] | None = None
        self.horovod_wheels = self.work / "horovod-wheel"

    @property
    def cuda(self) -> bool:
        return self.settings.cuda

    def n_for(self, backend: str) -> int:
        import parallelx

        return self.nproc if parallelx.backend_class(backend).launcher.multi_process else 1

    # ---------------------------------------------------------- install

    def install_steps(self) -> None:
        """Items for what gpu_check.sh did before this script started (a TSV: name, status, seconds, detail)."""
        path = self.args.install_steps
        if path is None:
            self.skip("install", "carried wheels", "not started through scripts/gpu_check.sh: nothing installed")
            return
        for row in Path(path).read_text().splitlines():
            name, rc, seconds, detail = (row.split("\t") + ["", "", "", ""])[:4]
            ok = rc.strip() == "0"
            self.record(Item("install", name, PASSED if ok else FAILED,
                             detail if ok else f"exit status {rc}: {detail}", seconds=float(seconds or 0)))

    def start_horovod_build(self) -> None:
        """Horovod has no wheel for current torch: build its carried sdist with
        NCCL operations in the background (at low priority) while the other
        checks use the GPU; its own checks run at the end if it finished."""
        name = "Horovod built with NCCL operations"
        if not self.cuda:
            self.skip("install", name, "CUDA only: the NCCL build needs a GPU and nvcc"
                      + (" (the dry run uses the Horovod already installed)" if not unavailable("horovod") else ""),
                      needs="cuda")
            return
        if importlib.util.find_spec("horovod") is not None:
            self.skip("install", name, "Horovod is already installed here; its build was not repeated")
            return
        sdist = self.args.horovod_sdist
        if sdist is None or not Path(sdist).is_file():
            self.skip("install", name, f"no Horovod sdist at {sdist}: run scripts/gpu_wheels.py and carry gpu-wheels/")
            return
        if shutil.which("nvcc") is None:
            self.skip("install", name, "nvcc is not on PATH: the NCCL build needs the CUDA compiler")
            return
        log = self.runner.logs / "horovod-build.log"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--build-horovod", str(Path(sdist).resolve()),
               "--wheel-dir", str(self.horovod_wheels)]
        print(f"[gpu-check] install / building Horovod in the background (log {log})", flush=True)
        self.horovod_started = time.monotonic()
        self.horovod_log = log
        with log.open("w") as log_file:  # the child keeps its own copy of the descriptor
            self.horovod_build = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=self.work,
                                                  start_new_session=True, preexec_fn=lambda: os.nice(10),
                                                  env=self.runner.env(_NoLauncher(), 600))

    def finish_horovod_build(self) -> None:
        """Wait for the background build while time is left for Horovod's own checks, then install it."""
        proc = self.horovod_build
        if proc is None:
            return
        name = "Horovod built with NCCL operations"

        def finish() -> Outcome:
            wait_s = self.remaining() - RESERVE_S - HOROVOD_CHECKS_S
            try:
                rc = proc.wait(timeout=max(1.0, wait_s))
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                raise Skip(f"the build had not finished after {time.monotonic() - self.horovod_started:.0f}s, "
                           f"and Horovod's checks need the last {HOROVOD_CHECKS_S:.0f}s of the budget; "
                           "Horovod was not checked") from None
            log = self.horovod_log.read_text(errors="replace")
            if rc != 0:
                raise Fail(f"the build exited with status {rc}", log=log)
            wheels = sorted(self.horovod_wheels.glob("horovod-*.whl"))
            if not wheels:
                raise Fail(f"the build wrote no wheel into {self.horovod_wheels}", log=log)
            target = ["--target", self.args.site, "--upgrade"] if self.args.site else []
            res = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps",
                                  "--disable-pip-version-check", *target, str(wheels[-1])],
                                 capture_output=True, text=True)
            if res.returncode != 0:
                raise Fail(f"pip could not install {wheels[-1].name}", log=res.stdout + res.stderr)
            # nccl_built() is NCCL's version code, 0 without NCCL.
            probe = subprocess.run([sys.executable, "-c", "import horovod.torch as h; print(h.nccl_built())"],
                                   capture_output=True, text=True, cwd=self.work,
                                   env=self.runner.env(_NoLauncher(), 60))
            code = probe.stdout.strip().splitlines()[-1:]
            if probe.returncode != 0 or not code or not code[0].isdigit() or int(code[0]) == 0:
                raise Fail("the built Horovod does not load with NCCL operations (horovod.torch.nccl_built())",
                           log=probe.stdout + probe.stderr)
            return Outcome(f"{wheels[-1].name}, NCCL operations built (NCCL {code[0]}), "
                           f"in {time.monotonic() - self.horovod_started:.0f}s")

        self.step("install", name, finish, needs="cuda")

    # ------------------------------------------------------ environment

    def environment(self) -> None:
        self.step("environment", "versions", self._versions)
        if self.cuda:
            self.step("environment", "GPU, CUDA, NCCL and cuDNN", self._gpu, needs="cuda")
        else:
            self.skip("environment", "GPU, CUDA, NCCL and cuDNN", "CUDA only: the dry run runs on the CPU",
                      needs="cuda")
        self.step("environment", "python -m parallelx env", self._parallelx_env, need_s=20)
        self.step("environment", "installed parallelx is this checkout", self._same_source)

    def _versions(self) -> Outcome:
        import torch
        import torchvision

        import parallelx

        facts = {"python": platform.python_version(), "executable": sys.executable,
                 "torch": torch.__version__, "torchvision": torchvision.__version__,
                 "parallelx": f"{parallelx.__version__} at {Path(parallelx.__file__).parent}",
                 "cpu_cores": os.cpu_count()}
        for dist in ("deepspeed", "horovod"):
            facts[dist] = _dist_version(dist)
        self.facts.update(facts)
        return Outcome(f"torch {torch.__version__}, parallelx {parallelx.__version__}, "
                       f"deepspeed {facts['deepspeed']}, horovod {facts['horovod']}")

    def _gpu(self) -> Outcome:
        import torch

        n = torch.cuda.device_count()
        gpus = [f"{torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))}, "
                f"{torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB)" for i in range(n)]
        nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else None
        facts = {"gpus": f"{n} x {gpus[0]}" if len(set(gpus)) == 1 else ", ".join(gpus),
                 "cuda": torch.version.cuda, "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
                 "cudnn": torch.backends.cudnn.version(), "driver": _nvidia_smi("driver_version"),
                 "nvcc": _nvcc_version(), "tf32_conv": torch.backends.cudnn.allow_tf32,
                 "tf32_matmul": torch.backends.cuda.matmul.allow_tf32}
        self.facts.update(facts)
        if facts["nccl"] is None:
            raise Fail("torch reports no NCCL: the ddp backend cannot use the GPUs", figures=facts)
        return Outcome(f"{facts['gpus']}; CUDA {facts['cuda']}, NCCL {facts['nccl']}, cuDNN {facts['cudnn']}, "
                       f"driver {facts['driver']}")

    def _parallelx_env(self) -> Outcome:
        res = self.runner.launch("single", ["-m", "parallelx", "env"], 1, timeout_s=self.timeout(120),
                                 log_name="parallelx-env")
        text = res.output().split("\n", 1)[-1]  # without the command line
        self.env_text = text
        if res.error():
            raise Fail(f"`python -m parallelx env` {res.error()}", log=text)
        usable = [line.split()[1] for line in text.splitlines() if line.strip().startswith("[OK]")]
        return Outcome(f"usable here: {', '.join(usable) or 'none'}")

    def _same_source(self) -> Outcome:
        import parallelx

        installed = Path(parallelx.__file__).resolve().parent
        if installed == (ROOT / "parallelx").resolve():
            raise Skip("parallelx runs from this checkout (an editable install): nothing to compare")
        differ = []
        for src_dir, dest in (("parallelx", installed), ("backends", installed / "backends"),
                              ("recipes", installed / "recipes")):
            for path in sorted((ROOT / src_dir).glob("*.py")):
                twin = dest / path.name
                if not twin.is_file() or twin.read_bytes() != path.read_bytes():
                    differ.append(f"{src_dir}/{path.name}")
        if differ:
            raise Fail(f"the installed parallelx ({installed}) differs from this checkout in {', '.join(differ[:6])}"
                       f"{' ...' if len(differ) > 6 else ''}: the wheel is stale; run scripts/gpu_wheels.py again")
        return Outcome(f"{installed} matches the checkout's sources")

    # ------------------------------------------------------------- data

    def make_data(self) -> None:
        def cifar() -> Outcome:
            from parallelx.recipes.make_data import make_cifar10

            make_cifar10(self.data / "cifar10", n_train=self.settings.cifar_train, n_test=self.settings.cifar_test,
                         seed=0)
            return Outcome(f"{self.settings.cifar_train} train / {self.settings.cifar_test} test images")

        def dogcat() -> Outcome:
            from parallelx.recipes.make_data import make_dogcat

            make_dogcat(self.data / "dogcat", n_per_class=self.settings.dogcat_per_class, seed=0, csv=True)
            return Outcome(f"{2 * self.settings.dogcat_per_class} JPEGs")

        self.step("recipes", "generated CIFAR-10 data", cifar)
        self.step("recipes", "generated Dogs-vs-Cats data", dogcat)

    # ---------------------------------------------------------- recipes

    def recipes(self, recipe: str, backends: Sequence[str]) -> None:
        for backend in backends:
            if backend not in self.settings.recipe_backends[recipe]:
                self.skip("recipes", f"{recipe} on {backend}", self.settings.fewer_because)
                continue
            self.step("recipes", f"{recipe} on {backend}", lambda b=backend: self._recipe(recipe, b),
                      need_s=30)

    def _recipe(self, recipe: str, backend: str) -> Outcome:
        import torch

        import parallelx

        if (why := unavailable(backend)) is not None:
            raise Skip(why)
        n = self.n_for(backend)
        out = self.work / "runs" / f"{recipe}-{backend}"
        shutil.rmtree(out, ignore_errors=True)
        extra = self.settings.cifar_args if recipe == "cifar10" else self.settings.dogcat_args
        target = ["-m", f"parallelx.recipes.{recipe}", "--backend", backend, *BACKEND_ARGS.get(backend, ()),
                  "--data-dir", str(self.data / recipe), "--out-dir", str(out), "--epochs", "1", *extra]
        timeout = self.timeout(self.settings.launch_timeout_s)
        res = self.runner.launch(backend, target, n, timeout_s=timeout, log_name=f"{recipe}-{backend}")
        output = res.output()
        if res.error():
            raise Fail(f"{parallelx.backend_class(backend).launcher.name} {res.error()}", log=output)
        metrics_file = out / "metrics.json"
        if not metrics_file.is_file():
            raise Fail(f"exited 0 but wrote no {metrics_file}", log=output)
        metrics = json.loads(metrics_file.read_text())
        world = n
        if metrics.get("backend") != backend or metrics.get("world_size") != world:
            raise Fail(f"metrics.json says backend {metrics.get('backend')!r}, world size {metrics.get('world_size')}; "
                       f"expected {backend!r} and {world}", log=output)
        batch = int(extra[extra.index("--batch-size") + 1])
        ref = self._reference(recipe, out / "best.pth", batch)
        rel = abs(metrics["final_val_loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-12)
        figures = {"val_acc": metrics["best_val_acc"], "reference_acc": ref["acc"],
                   "val_loss": metrics["final_val_loss"], "loss_rel_diff": rel,
                   "images_per_s": metrics.get("train_images_per_s"), "launch_s": res.seconds}
        device = "GPU" if self.cuda else "CPU"
        how = f"{parallelx.backend_class(backend).launcher.name}, {world} process{'es' if world > 1 else ''}"
        if backend == "dp":
            gpus = torch.cuda.device_count() if self.cuda else 0
            how = (f"DataParallel over {gpus} GPUs" if gpus > 1 else
                   "ran as single: DataParallel needs 2 GPUs to split a batch")
        if metrics["best_val_acc"] != ref["acc"] or rel > self.settings.loss_rtol:
            raise Fail(f"reported val acc {metrics['best_val_acc']} and loss {metrics['final_val_loss']:.6g}; a "
                       f"single-process evaluation of best.pth gives {ref['acc']} and {ref['loss']:.6g} "
                       f"(loss relative tolerance {self.settings.loss_rtol:g})", log=output, figures=figures)
        return Outcome(f"{how} on the {device}; val acc {ref['acc']:.4f} over {ref['count']} images equals "
                       f"best.pth's, loss within {rel:.1e}", figures)

    def _reference(self, recipe: str, best: Path, batch: int) -> dict[str, float]:
        """A single-process evaluation of ``best.pth`` on the run's device, in the run's val batches."""
        import torch

        from parallelx.recipes.engine import evaluate_state_dict

        if recipe == "cifar10":
            from parallelx.recipes.data import load_cifar10
            from parallelx.recipes.models import LeNet

            model = LeNet()
            model.load_state_dict(torch.load(best, map_location="cpu", weights_only=True))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the generated data's md5 sums are not the official ones
                val = load_cifar10(self.data / recipe)[1]
        else:
            from parallelx.recipes.data import load_dogcat
            from parallelx.recipes.models import vgg16_for_dogcat

            model = vgg16_for_dogcat(weights=best)
            val = load_dogcat(self.data / recipe, self.settings.dogcat_size)[1]
        device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        try:
            return evaluate_state_dict(model.to(device), OnDevice(val, device), batch_size=batch)
        finally:
            del model
            if self.cuda:
                torch.cuda.empty_cache()

    def dp_scatter(self) -> None:
        name = "DataParallel scatter over GPUs"
        if not self.cuda:
            self.skip("recipes", name, "CUDA only (and needs 2 GPUs)", needs="cuda")
            return
        import torch

        gpus = torch.cuda.device_count()
        if gpus < 2:
            self.skip("recipes", name, f"needs 2 GPUs, {gpus} visible: the dp runs above ran as single", needs="cuda")
            return
        dp = [i for i in self.items if i.section == "recipes" and i.name.endswith(" on dp")]
        status = section_status(dp)
        self.record(Item("recipes", name, status, f"the dp runs above split each batch over {gpus} GPUs",
                         needs="cuda"))

    # ------------------------------------------------------- throughput

    def throughput(self) -> None:
        s = self.settings
        for precision, extra in PRECISIONS.items():
            name = f"VGG16 {CUDA.image_size} px, {CUDA.batch}/process, {precision}"
            if extra is None:
                self.skip("throughput", name, precision_missing_reason(precision), needs="cuda")
                continue
            if not self.cuda:
                self.skip("throughput", name, "CUDA only: VGG16 at 224 px is the GPU workload", needs="cuda")
                name = f"same-process harness on the CPU (LeNet, {s.batch}/process, {precision}; numbers mean nothing)"
            self.step("throughput", name, lambda e=extra, p=precision: self._throughput(p, e), need_s=45)

    def _throughput(self, precision: str, extra: tuple[str, ...]) -> Outcome:
        from benchmarks import stats
        from benchmarks.workload import Case, Plan, cpu_cores

        if (why := unavailable("ddp")) is not None:
            raise Skip(why)
        s, n = self.settings, self.nproc
        case = Case(model=s.model, batch=s.batch, image_size=s.image_size, warmup=s.warmup, steps=s.steps,
                    lr=0.001 if s.model == "vgg16" else 0.01)
        out = self.work / f"throughput-{precision}"
        shutil.rmtree(out, ignore_errors=True)
        plan_file = self.work / f"throughput-{precision}.json"
        Plan(impl="same-ddp", nproc=n, threads=max(1, cpu_cores() // n), out=str(out), cases=[case]).dump(plan_file)
        res = self.runner.launch("ddp", ["-m", "benchmarks.same_process", "--backend", "ddp", "--blocks",
                                         str(s.blocks), "--plan", str(plan_file), *extra], n,
                                 timeout_s=self.timeout(240), log_name=f"throughput-{precision}")
        if res.error():
            raise Fail(f"torchrun {res.error()}", log=res.output())
        reports = [json.loads(p.read_text()) for p in sorted(out.glob("same-ddp.*.rank*.json"))]
        if len(reports) != n:
            raise Fail(f"expected {n} rank report(s) in {out}, found {len(reports)}", log=res.output())
        entry = stats.same_process(reports)
        px_s, plain_s = entry["median_step_s"], entry["baseline_median_step_s"]
        faster = sum(r < 1 for r in entry["per_round"])
        figures = {"parallelx_ms": px_s * 1e3, "plain_ms": plain_s * 1e3, "ratio": entry["ratio"],
                   "ci95": entry["ci95"], "parallelx_images_per_s": n * s.batch / px_s,
                   "plain_images_per_s": n * s.batch / plain_s, "blocks_parallelx_faster": f"{faster}/{s.blocks}",
                   "device": reports[0]["device"]}
        building = self.horovod_build is not None and self.horovod_build.poll() is None
        verdict = ("within" if entry["ratio"] <= stats.RATIO_TARGET else "ABOVE") + f" the {stats.RATIO_TARGET} target"
        note = "; measured while Horovod was building in the background (at low priority)" if building else ""
        return Outcome(f"parallelx / plain DDP median step time {entry['ratio']:.3f} ({verdict}; not a pass "
                       f"criterion), {n * s.batch / px_s:.0f} images/s{note}", figures)

    # -------------------------------------------------------- host sync

    def host_sync(self, backends: Sequence[str]) -> None:
        for backend in backends:
            if backend not in self.settings.sync_backends:
                continue
            self.step("host-sync", f"training loop on {backend}", lambda b=backend: self._host_sync(b), need_s=35)
            if not self.cuda:
                self.skip("host-sync", f"synchronisations per step on {backend}",
                          "CUDA only: torch.cuda.set_sync_debug_mode counts them on a GPU", needs="cuda")

    def _host_sync(self, backend: str) -> Outcome:
        if (why := unavailable(backend)) is not None:
            raise Skip(why)
        import parallelx

        s, n = self.settings, self.n_for(backend)
        out = self.work / f"sync-{backend}"
        shutil.rmtree(out, ignore_errors=True)
        plan = {"backend": backend, "nproc": n, "batch": s.sync_batch, "warmup": s.sync_steps[0],
                "short": s.sync_steps[1], "long": s.sync_steps[2], "workers": s.sync_workers, "out": str(out)}
        plan_file = self.work / f"sync-{backend}.json"
        plan_file.write_text(json.dumps(plan))
        res = self.runner.launch(backend, [str(Path(__file__).resolve()), "--worker", "sync", "--plan", str(plan_file)],
                                 n, timeout_s=self.timeout(150), log_name=f"sync-{backend}")
        if res.error():
            raise Fail(f"{parallelx.backend_class(backend).launcher.name} {res.error()}", log=res.output())
        reports = [json.loads(p.read_text()) for p in sorted(out.glob("sync.rank*.json"))]
        if len(reports) != n:
            raise Fail(f"expected {n} rank report(s) in {out}, found {len(reports)}", log=res.output())
        main = reports[0]  # the main rank shows the progress bar, the one reading the loss
        px, plain = main["loops"]["parallelx"], main["loops"].get("plain")
        figures: dict[str, Any] = {"parallelx_step_ms": px["step_s"] * 1e3}
        text = f"parallelx loop {px['step_s'] * 1e3:.2f} ms/step"
        if plain is not None:
            figures["plain_step_ms"] = plain["step_s"] * 1e3
            figures["step_ratio"] = px["step_s"] / plain["step_s"]
            text += f", plain {plain['step_s'] * 1e3:.2f} ms/step (ratio {figures['step_ratio']:.3f})"
        else:
            text += " (no plain loop for this backend)"
        text += f"; LeNet, {s.sync_batch}/process, {s.sync_steps[2] - s.sync_steps[1]} steps timed"
        if px["syncs_per_step"] is None:
            return Outcome(text + "; syncs not counted on the CPU", figures)
        # The CUDA-only half: one more item from the same launch.
        item = sync_item(backend, reports)
        item.log = res.output() if item.status == FAILED else None
        self.record(item)
        return Outcome(text, figures)


def sync_item(backend: str, reports: Sequence[dict[str, Any]]) -> Item:
    """The verdict on the synchronisations counted per training step: the
    main rank's (the one whose progress bar reads the loss) parallelx loop
    may exceed the plain framework's own loop by less than
    :data:`SYNC_EXCESS_LIMIT` (a framework that synchronises every step by
    itself is not parallelx's doing)."""
    loops = reports[0]["loops"]
    px = loops["parallelx"]["syncs_per_step"]
    plain = loops["plain"]["syncs_per_step"] if "plain" in loops else None
    excess = px - (plain or 0.0)
    figures = {"parallelx_syncs_per_step": px, "plain_syncs_per_step": plain,
               "other_ranks_max": max((r["loops"]["parallelx"]["syncs_per_step"] for r in reports[1:]), default=None)}
    plain_txt = "no plain loop" if plain is None else f"plain {plain:.2f}"
    detail = (f"parallelx's loop {px:.2f} syncs/step on the main rank, {plain_txt}; expected about 0.1 (the progress "
              f"bar reads the loss every 10th step) and less than {SYNC_EXCESS_LIMIT} above the plain loop")
    if excess >= SYNC_EXCESS_LIMIT:
        detail += ": something in parallelx's step or loop waits for the GPU (.item(), .cpu(), bool() of a tensor)"
    status = PASSED if excess < SYNC_EXCESS_LIMIT else FAILED
    return Item("host-sync", f"synchronisations per step on {backend}", status, detail, figures, needs="cuda")


class _NoLauncher:
    """The environment of a helper process that is not a launch."""

    @staticmethod
    def env() -> dict[str, str]:
        return {}


class OnDevice:
    """A dataset whose samples are already on ``device``: the recipes'
    single-process evaluation (``evaluate_state_dict``) then runs there."""

    def __init__(self, dataset: Any, device: Any) -> None:
        self.dataset, self.device = dataset, device

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        import torch

        x, y = self.dataset[index]
        return x.to(self.device), torch.as_tensor(y, device=self.device)


def precision_missing_reason(precision: str) -> str:
    if parallelx_offers(precision):
        return (f"parallelx now offers --precision {precision}, but this check does not pass it yet: "
                f"set PRECISIONS[{precision!r}] in scripts/gpu_check.py")
    return (f"the option does not exist yet: parallelx.add_arguments defines no --precision {precision}; "
            "measured here once it does")


def parallelx_offers(precision: str) -> bool:
    """Whether parallelx's command line accepts ``--precision PRECISION``."""
    import parallelx

    parser = argparse.ArgumentParser(add_help=False)
    parallelx.add_arguments(parser)
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            ns, rest = parser.parse_known_args(["--precision", precision])
        except SystemExit:  # the option exists without that choice
            return False
    return not rest and getattr(ns, "precision", None) == precision


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _nvidia_smi(field_name: str) -> str | None:
    try:
        res = subprocess.run(["nvidia-smi", f"--query-gpu={field_name}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip().splitlines()[0] if res.returncode == 0 and res.stdout.strip() else None


def _nvcc_version() -> str | None:
    try:
        res = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln for ln in res.stdout.splitlines() if "release" in ln]
    return lines[-1].split("release", 1)[1].strip() if lines else None


# ------------------------------------------------------ the sync worker

@contextlib.contextmanager
def count_syncs(device: Any) -> Iterator[list[int]]:
    """Count the synchronising CUDA calls made inside the block (on the CPU:
    nothing to count, the list stays empty).  ``set_sync_debug_mode("warn")``
    makes every such call issue a warning; all of them are recorded."""
    import torch

    found: list[int] = []
    if device.type != "cuda":
        yield found
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found.append(sum("synchronizing CUDA operation" in str(w.message) for w in caught))


def sync_worker(plan_file: Path) -> int:
    """One rank of the host-sync check, under its backend's launcher: the
    recipes' loop (``run_epoch``) and the plain framework's loop on the same
    loader, each run for a short and a long number of steps; the differences
    give per-step figures free of set-up and end-of-pass costs."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks import px_worker, same_process, workload
    from parallelx.recipes.engine import run_epoch

    p = json.loads(plan_file.read_text())
    case = workload.Case(model="lenet", batch=p["batch"], image_size=32, warmup=0, steps=1, lr=0.01)
    plan = workload.Plan(impl=f"sync-{p['backend']}", nproc=p["nproc"],
                         threads=max(1, workload.cpu_cores() // p["nproc"]), out=p["out"], cases=[case])
    with px_worker.make_backend(p["backend"], plan) as backend:
        workload.check_world_size(plan, backend.world_size)
        device = backend.device
        steps = p["warmup"] + p["long"] + 1
        g = torch.Generator().manual_seed(0)
        n = case.batch * backend.world_size * steps
        data = TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
        loader = DataLoader(data, batch_size=case.batch, sampler=backend.make_sampler(data, shuffle=True, seed=0),
                            num_workers=p["workers"], pin_memory=device.type == "cuda",
                            persistent_workers=p["workers"] > 0)
        base = workload.build_model(case)
        model, optimizer = backend.setup(base, workload.make_optimizer(base, case))
        criterion = nn.CrossEntropyLoss(reduction="none")

        def px_loop(k: int) -> None:
            run_epoch(backend, model, loader, criterion, optimizer=optimizer, max_steps=k)

        loops: dict[str, Callable[[int], None]] = {"parallelx": px_loop}
        plain = same_process.PLAIN.get(p["backend"])
        if plain is not None:
            plain_step, _ = plain(case, backend)

            def plain_loop(k: int) -> None:
                # The plain script's loop: the same loader, the same copies to the device.
                for i, (x, y) in enumerate(loader):
                    if i >= k:
                        break
                    plain_step(x.to(device, non_blocking=True), y.to(device, non_blocking=True))

            loops["plain"] = plain_loop
        result: dict[str, Any] = {}
        for name, loop in loops.items():
            loop(p["warmup"])
            runs = {}
            for k in (p["short"], p["long"]):
                workload.synchronize(device)
                start = time.perf_counter()
                with count_syncs(device) as found:
                    loop(k)
                workload.synchronize(device)  # outside the count: it is ours, not the loop's
                runs[k] = {"seconds": time.perf_counter() - start, "syncs": found[0] if found else None}
            short, long = runs[p["short"]], runs[p["long"]]
            k = p["long"] - p["short"]
            result[name] = {"runs": runs, "step_s": (long["seconds"] - short["seconds"]) / k,
                            "syncs_per_step": None if long["syncs"] is None else (long["syncs"] - short["syncs"]) / k}
        out = Path(p["out"])
        out.mkdir(parents=True, exist_ok=True)
        (out / f"sync.rank{backend.rank}.json").write_text(json.dumps(
            {"rank": backend.rank, "world_size": backend.world_size, "device": str(device), "loops": result}))
    return 0


# ----------------------------------------------------- the Horovod build

def horovod_source(sdist: Path, into: Path) -> Path:
    """Horovod's sources from ``sdist`` under ``into``, patched for a GPU build."""
    import build_horovod as bh  # scripts/, beside this file

    with tarfile.open(sdist) as tar:
        tar.extractall(into, filter="data")
    src = into / f"horovod-{bh.HOROVOD_VERSION}"
    bh.patch_source(src, gpu=True)
    # CUDA 13's headers (CCCL) refuse anything below C++17; Horovod pins its CUDA kernels to C++11.
    bh.patch(src / "horovod/common/ops/cuda/CMakeLists.txt", "set(CMAKE_CUDA_STANDARD 11)",
             "set(CMAKE_CUDA_STANDARD 17)")
    # The driver's unversioned libcuda.so is a development link that driver-only machines
    # (containers) often lack; libcuda.so.1, its soname, is always there (torch loads it).
    bh.patch(src / "horovod/torch/cuda_util.cc", 'dlopen("libcuda.so", RTLD_LAZY)', 'dlopen("libcuda.so.1", RTLD_LAZY)')
    return src


def build_horovod(sdist: Path, wheel_dir: Path) -> int:
    """Build Horovod from the carried sdist with NCCL operations: the patches
    of ``scripts/build_horovod.py`` (C++20 for current torch), plus what the
    GPU machine's CUDA 13 needs, and NCCL from torch's own wheel."""
    import torch

    import build_horovod as bh  # scripts/, beside this file

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hvd-gpu-") as tmp:
        tmp_path = Path(tmp)
        src = horovod_source(sdist, tmp_path)
        env = dict(os.environ)
        # As scripts/build_horovod.py builds it, with NCCL operations on top.
        env.update(HOROVOD_WITH_PYTORCH="1", HOROVOD_WITH_GLOO="1", HOROVOD_WITHOUT_MPI="1",
                   HOROVOD_WITHOUT_TENSORFLOW="1", HOROVOD_WITHOUT_MXNET="1", HOROVOD_GPU_OPERATIONS="NCCL",
                   MAKEFLAGS=env.get("MAKEFLAGS", f"-j{max(2, (os.cpu_count() or 4) - 2)}"))
        # The bundled gloo and flatbuffers ask for CMake 2.8.12, which CMake 4 (pip's cmake there
        # may be one) refuses unless told the oldest policies it must emulate; older CMakes ignore this.
        env.setdefault("CMAKE_POLICY_VERSION_MINIMUM", "3.5")
        # Only this GPU's architecture: Horovod otherwise builds every one nvcc knows (slow, and
        # CUDA 13 no longer knows some of Horovod's defaults).
        major, minor = torch.cuda.get_device_capability(0)
        env.setdefault("HOROVOD_BUILD_CUDA_CC_LIST", f"{major}{minor}")
        nvcc = shutil.which("nvcc")
        if nvcc is not None:
            env.setdefault("HOROVOD_CUDA_HOME", str(Path(nvcc).resolve().parents[1]))
        nccl = nccl_dirs()
        if nccl is not None:
            # torch's wheel ships libnccl.so.2 only: CMake's find_library wants libnccl.so.
            links = tmp_path / "nccl-lib"
            links.mkdir()
            lib = sorted(nccl[1].glob("libnccl.so*"))[0]
            (links / "libnccl.so").symlink_to(lib)
            env.update(HOROVOD_NCCL_INCLUDE=str(nccl[0]), HOROVOD_NCCL_LIB=str(links), HOROVOD_NCCL_LINK="SHARED")
        bh.log(f"building with CC list {env['HOROVOD_BUILD_CUDA_CC_LIST']}, CUDA at {env.get('HOROVOD_CUDA_HOME')}, "
               f"NCCL {nccl}")
        bh.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index",
                str(src), "-w", str(wheel_dir)], env=env)
    bh.log(f"built in {time.monotonic() - started:.0f}s")
    return 0


# ---------------------------------------------------------------- main

def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU mode: everything except what needs CUDA (CI runs this)")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "gpu-report"),
                        help="where report.md and summary.json go (default $OUT, else gpu-report/)")
    parser.add_argument("--work", default=None,
                        help="scratch folder for data, runs and logs, kept afterwards (default: a temporary one, "
                             "removed at the end)")
    parser.add_argument("--deadline", type=float, default=None,
                        help=f"Unix time by which to finish (default: {BUDGET_S:.0f}s from now)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="processes per multi-process launch (default: the GPUs; 2 in the dry run)")
    parser.add_argument("--only", type=lambda s: s.split(","), default=list(SECTIONS),
                        help=f"comma-separated sections to run ({','.join(SECTIONS)})")
    parser.add_argument("--horovod-sdist", default=None, help="Horovod's sdist, built with NCCL if not installed")
    parser.add_argument("--site", default=None, help="the --target folder the carried wheels went to (for Horovod's)")
    parser.add_argument("--install-steps", default=None, help=argparse.SUPPRESS)  # written by gpu_check.sh
    parser.add_argument("--worker", choices=["sync"], help=argparse.SUPPRESS)
    parser.add_argument("--plan", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--build-horovod", type=Path, metavar="SDIST", help=argparse.SUPPRESS)
    parser.add_argument("--wheel-dir", type=Path, help=argparse.SUPPRESS)
    # The deepspeed launcher appends --local_rank=N to a worker's arguments.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = set(args.only) - set(SECTIONS)
    if unknown:
        parser.error(f"--only: unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    return args


def _on_sigterm(signum: int, frame: object) -> None:
    # Unwinds through run_logged (which kills the running launch) to the report.
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker == "sync":
        return sync_worker(args.plan)
    if args.build_horovod is not None:
        return build_horovod(args.build_horovod, args.wheel_dir)
    try:
        import parallelx  # noqa: F401
    except ImportError as exc:
        print(f"error: parallelx is not importable with {sys.executable} ({exc}); on the GPU machine run "
              "`bash scripts/gpu_check.sh`, here `make setup`", file=sys.stderr)
        return 2
    import torch

    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("error: no CUDA device is visible; on a machine without one run the CPU mode: "
              "scripts/gpu_check.py --dry-run", file=sys.stderr)
        return 2
    settings = CUDA if cuda else DRY_RUN
    nproc = args.nproc or (torch.cuda.device_count() if cuda else 2)
    check = GpuCheck(args, settings, nproc)
    signal.signal(signal.SIGTERM, _on_sigterm)
    # Benchmarks and the top-level recipes package, without the checkout's root on the path.
    sys.path.append(str(check.runner.pythonpath))
    print(f"[gpu-check] {'CUDA' if cuda else 'dry run on the CPU'}, {nproc} process(es) per launch, "
          f"{check.remaining():.0f}s budget; work in {check.work}; report in {check.out}", flush=True)
    try:
        check.install_steps()
        check.start_horovod_build()  # first: it has the longest way to go
        check.environment()
        check.make_data()
        early = [b for b in BACKENDS if b != "horovod" or check.horovod_build is None]
        check.recipes("cifar10", early)
        check.throughput()
        check.host_sync(early)
        check.recipes("dogcat", early)
        check.dp_scatter()
        if check.horovod_build is not None:
            check.finish_horovod_build()
            check.recipes("cifar10", ["horovod"])
            check.recipes("dogcat", ["horovod"])
            check.host_sync(["horovod"])
    except (SystemExit, KeyboardInterrupt) as exc:
        check.record(Item("install", "the check itself", FAILED, f"interrupted ({exc!r}) before it finished"))
    finally:
        if check.horovod_build is not None and check.horovod_build.poll() is None:
            _kill_group(check.horovod_build)
        check.write()
        if args.work is None:  # our own temporary folder: runs hold 0.5 GB VGG16 checkpoints
            shutil.rmtree(check.work, ignore_errors=True)
    summary = check.summary()
    c = summary["counts"]
    print(f"[gpu-check] {summary['result'].upper()}: {c[PASSED]} passed, {c[FAILED]} failed, {c[SKIPPED]} skipped "
          f"in {summary['seconds']:.0f}s; {check.out / 'report.md'}", flush=True)
    return 0 if summary["result"] == PASSED else 1


if __name__ == "__main__":
    sys.exit(main())
