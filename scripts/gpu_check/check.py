"""The GPU check's settings and machinery: how much each part runs on CUDA and
in the CPU dry run, steps run against the deadline (each recorded as an
:class:`Item`), and the report, rewritten after every step so that a run cut
short still leaves one."""

from __future__ import annotations

import datetime as dt
import json
import os
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .workers import nccl_dirs

if TYPE_CHECKING:
    from parallelx.launching.runner import Finished

ROOT = Path(__file__).resolve().parents[2]
#: The command; the check's own helper processes (the host-sync worker under
#: each launcher, the Horovod build) are started through it too.
ENTRY = ROOT / "scripts" / "gpu_check.py"
#: The whole check, installation included: the GPU machine gives 10
#: minutes a command, so 8 leave room for its start and the transfers.
BUDGET_S = 480.0
RESERVE_S = 10.0  # kept free at the end for writing the report
SECTIONS = ("install", "environment", "recipes", "throughput", "fsdp", "transformers", "host-sync")
#: Every backend the recipes run on; the in-process ones (single, dp) start one process.
BACKENDS = ("single", "dp", "ddp", "deepspeed", "fsdp", "horovod")
#: The backend options each recipe run adds (DeepSpeed: ZeRO-2 shards gradients and optimizer state).
BACKEND_ARGS: dict[str, tuple[str, ...]] = {"deepspeed": ("--zero-stage", "2")}
#: Precisions the throughput section measures: the same-process worker's extra arguments for each.
PRECISIONS: dict[str, tuple[str, ...]] = {"fp32": (), "bf16-mixed": ("--precision", "bf16-mixed")}
#: The parallelx step may synchronise with the host this many times per step
#: more than the plain framework's: 0.1 is expected (the progress bar reads
#: the loss every 10th step on the main rank); once per step would be 1.
SYNC_EXCESS_LIMIT = 0.5
#: The transformers section's GPT options: what CUDA changes under them is inductor's Triton kernels,
#: the recomputation's replay of CUDA's random numbers, the copies between GPU and CPU memory.
COMPILE, CHECKPOINTING, OFFLOAD = ("--compile",), ("--activation-checkpointing", "auto"), ("--cpu-offload",)
#: Tensor parallelism over the visible GPUs (NCCL): 2 ranks split each block, the rest data parallel.
TENSOR_PARALLEL = ("--tensor-parallel", "2")
#: The GPT recipe on each backend with each option, every one after its twin without (``()``); DeepSpeed
#: at ZeRO-3, whose forward gathers the weights as fsdp's does.
GPT_CASES: dict[str, tuple[tuple[str, ...], ...]] = {
    "ddp": ((), COMPILE, TENSOR_PARALLEL),
    "fsdp": ((), COMPILE, CHECKPOINTING, OFFLOAD, TENSOR_PARALLEL),
    "deepspeed": ((), COMPILE, CHECKPOINTING, OFFLOAD),
}
GPT_BACKEND_ARGS: dict[str, tuple[str, ...]] = {"deepspeed": ("--zero-stage", "3")}
HOROVOD_CHECKS_S = 100.0  # what the Horovod recipes and loop need once it is built
PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
FIGURE_SECTIONS = ("throughput", "host-sync")  # whose figures report.md shows beside each check


@dataclass(frozen=True, kw_only=True)
class Settings:
    """How much each part runs: on CUDA, and in the CPU dry run (which CI runs: about 2 minutes on 2 idle cores)."""

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
    #: The reported val loss against best.pth's: on the CPU the same float arithmetic in another
    #: order; on GPUs cuDNN may also choose other kernels for other batch splits.
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
    sync_backends: tuple[str, ...]  # whose training loop the host-sync section measures
    gpt_args: tuple[str, ...]  # the transformers section's GPT: size, optimizer steps, precision
    gpt_cases: dict[str, tuple[tuple[str, ...], ...]]  # those of GPT_CASES that run
    #: A run's final val loss against its twin's. On GPUs in bf16-mixed the compiled kernels round elsewhere,
    #: the attention's backward adds in any order, and AdamW makes whole steps of rounding noise: bf16-mixed
    #: itself ends 2 % from float32 (10 steps on the CPU), a run that does not train 30 % above.
    gpt_rtol: float


CUDA = Settings(
    cuda=True,
    cifar_train=2000,
    cifar_test=501,
    dogcat_per_class=20,
    cifar_args=("--batch-size", "64"),
    dogcat_args=("--image-size", "224", "--batch-size", "8", "--max-steps", "3", "--lr", "0.001"),
    dogcat_size=224,
    recipe_backends={"cifar10": BACKENDS, "dogcat": BACKENDS},
    fewer_because="",
    loss_rtol=1e-4,
    launch_timeout_s=180,
    model="vgg16",
    image_size=224,
    batch=32,
    warmup=2,
    steps=10,
    blocks=6,
    sync_batch=256,
    sync_steps=(5, 10, 60),
    sync_workers=4,
    sync_backends=("single", "ddp", "deepspeed", "horovod"),
    gpt_args=("--precision", "bf16-mixed", "--max-steps", "10"),  # the recipe's size: 0.46 M parameters
    gpt_cases=GPT_CASES,
    gpt_rtol=5e-2,
)
DRY_RUN = Settings(
    cuda=False,
    cifar_train=300,
    cifar_test=51,
    dogcat_per_class=13,
    cifar_args=("--batch-size", "32"),
    dogcat_args=("--image-size", "32", "--batch-size", "4", "--max-steps", "2", "--lr", "0.001"),
    dogcat_size=32,
    loss_rtol=1e-5,
    launch_timeout_s=150,
    # About 2 minutes on 2 idle cores: each launcher once, VGG16 in one launch, one precision
    # through the harness, one GPT pair; tests/launcher runs every backend on both recipes.
    recipe_backends={"cifar10": ("ddp", "deepspeed", "horovod"), "dogcat": ("single",)},
    fewer_because="dry run: each launcher once (CIFAR-10 under torchrun, the deepspeed launcher "
    "and horovodrun, VGG16 in one process), to keep the dry run short (tests/launcher runs the recipes "
    "under every backend)",
    model="lenet",
    image_size=32,
    batch=32,
    warmup=1,
    steps=3,
    blocks=2,
    sync_batch=32,
    sync_steps=(1, 2, 6),
    sync_workers=0,
    sync_backends=("ddp",),
    # float32, where recomputing the blocks (dropout's draws replayed) must give the run without it to the bit.
    gpt_args=("--n-layer", "2", "--n-embd", "32", "--generated-chars", "20000", "--max-steps", "3"),
    gpt_cases={"fsdp": ((), CHECKPOINTING)},
    gpt_rtol=0.0,
)


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
        self.log, self.figures = log, figures or {}


@dataclass
class Outcome:
    detail: str
    figures: dict[str, Any] = field(default_factory=dict)


def section_status(items: Sequence[Item]) -> str:
    if any(i.status == FAILED for i in items):
        return FAILED
    return PASSED if any(i.status == PASSED for i in items) else SKIPPED


class Check:
    """Runs steps against a deadline and keeps the report up to date."""

    def __init__(
        self, out: Path, work: Path, deadline: float, settings: Settings, nproc: int, only: Sequence[str] = SECTIONS
    ) -> None:
        self.out, self.work, self.deadline, self.settings, self.nproc = out, work, deadline, settings, nproc
        self.cuda, self.only, self.started = settings.cuda, set(only), time.time()
        self.items: list[Item] = []
        self.env_text = ""
        self.facts: dict[str, Any] = {}
        self.logs, self.data = work / "logs", work / "data"
        self.logs.mkdir(parents=True, exist_ok=True)
        # Launches run the way a user's would: from a folder outside the checkout (so that the installed
        # parallelx is the one that runs), with benchmarks/ and the top-level recipes/ reachable through a
        # folder of links on PYTHONPATH (the checkout's root there would shadow the installed parallelx).
        self.pythonpath = work / "pythonpath"
        self.pythonpath.mkdir(exist_ok=True)
        for name in ("benchmarks", "recipes"):
            if not (self.pythonpath / name).exists():
                (self.pythonpath / name).symlink_to(ROOT / name, target_is_directory=True)

    def env(self, timeout_s: float) -> dict[str, str]:
        """What every process the check starts adds to :func:`parallelx.launching.runner.job_env`."""
        env = {
            "PARALLELX_TIMEOUT": str(int(max(30, min(120, timeout_s - 10)))),  # before the launch's own timeout
            "PYTHONPATH": os.pathsep.join(filter(None, [str(self.pythonpath), os.environ.get("PYTHONPATH")])),
        }
        if self.cuda:
            # One machine: NCCL's bootstrap stays on the loopback interface, as Gloo's does.
            env["NCCL_SOCKET_IFNAME"] = os.environ.get("NCCL_SOCKET_IFNAME", "lo")
            if (nccl := nccl_dirs()) is not None:
                env["LD_LIBRARY_PATH"] = os.pathsep.join(
                    filter(None, [str(nccl[1]), os.environ.get("LD_LIBRARY_PATH")])
                )
        else:
            env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run stays on the CPU, on a GPU machine too
        return env

    def launch(self, backend: str, target: list[str], *, timeout_s: float, log_name: str) -> Finished:
        """``target`` under ``backend``'s launcher, one process per GPU (one for the in-process backends)."""
        from parallelx import describe
        from parallelx.launching import runner

        return runner.launch(
            describe(backend).launcher,
            target,
            self.nproc,
            timeout=timeout_s,
            env=self.env(timeout_s),
            cwd=self.work,
            log=self.logs / f"{log_name}.log",
        )

    def launched(self, backend: str, target: list[str], *, cap: float, log_name: str) -> Finished:
        """:meth:`launch` with the step's timeout; a backend that cannot run skips the step, a failed launch
        fails it with its output."""
        from parallelx import describe

        if (why := unavailable(backend)) is not None:
            raise Skip(why)
        done = self.launch(backend, target, timeout_s=self.timeout(cap), log_name=log_name)
        if done.error():
            raise Fail(f"{describe(backend).launcher.name} {done.error()}", log=done.output)
        return done

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

    def step(
        self, section: str, name: str, fn: Callable[[], Outcome], *, need_s: float = 0.0, needs: str | None = None
    ) -> Item:
        """Run ``fn`` as one check; it returns an :class:`Outcome`, or raises
        :class:`Skip` or :class:`Fail`.  Any other exception fails the step
        with its traceback in the log: a broken step must not stop the others."""
        if section not in self.only:
            return self.skip(section, name, "not selected (--only)", needs=needs)
        left = self.remaining() - RESERVE_S
        if left < need_s:
            return self.skip(
                section,
                name,
                f"out of time: {max(0, left):.0f}s of the budget left, this step needs about {need_s:.0f}s",
                needs=needs,
            )
        start, item = time.monotonic(), Item(section, name, PASSED, needs=needs)
        try:
            outcome = fn()
            item.detail, item.figures = outcome.detail, outcome.figures
        except Skip as exc:
            item.status, item.detail = SKIPPED, str(exc)
        except Fail as exc:
            item.status, item.detail, item.log, item.figures = FAILED, str(exc), exc.log, exc.figures
        except Exception as exc:
            item.status, item.detail, item.log = FAILED, f"{type(exc).__name__}: {exc}", traceback.format_exc()
        item.seconds = time.monotonic() - start
        return self.record(item)

    def summary(self) -> dict[str, Any]:
        sections = {
            name: {
                "status": section_status(items := [i for i in self.items if i.section == name]),
                "items": [{k: v for k, v in asdict(i).items() if k not in ("section", "log")} for i in items],
            }
            for name in SECTIONS
        }
        counts = {s: sum(i.status == s for i in self.items) for s in (PASSED, FAILED, SKIPPED)}
        return {
            "result": FAILED if counts[FAILED] else PASSED,
            "mode": "cuda" if self.settings.cuda else "dry-run",
            "nproc": self.nproc,
            "counts": counts,
            "seconds": round(time.time() - self.started, 1),
            "started": dt.datetime.fromtimestamp(self.started, dt.timezone.utc).isoformat(timespec="seconds"),
            "environment": self.facts,
            "logs": str(self.work / "logs"),
            "sections": sections,
            "skipped_cuda_only": [
                f"{i.section} / {i.name}" for i in self.items if i.status == SKIPPED and i.needs == "cuda"
            ],
        }

    def write(self) -> None:
        """``summary.json`` and ``report.md``, each replaced whole (a reader never sees half a file)."""
        self.out.mkdir(parents=True, exist_ok=True)
        summary = self.summary()
        for name, text in (
            ("summary.json", json.dumps(summary, indent=1, default=str) + "\n"),
            ("report.md", self.markdown(summary)),
        ):
            tmp = self.out / (name + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, self.out / name)

    def markdown(self, summary: dict[str, Any]) -> str:
        counts = summary["counts"]
        lines = [
            "# parallelx GPU check",
            "",
            f"**Result: {summary['result'].upper()}**: {counts[PASSED]} passed, {counts[FAILED]} failed, "
            f"{counts[SKIPPED]} skipped, in {summary['seconds']:.0f} s (started {summary['started']}).",
            "",
            f"Mode: {'CUDA' if summary['mode'] == 'cuda' else 'dry run on the CPU (what needs CUDA is skipped)'}; "
            f"{summary['nproc']} process(es) per multi-process launch; {self.facts.get('gpus') or 'CPU only'}.",
            "",
            "| section | status | passed | failed | skipped |",
            "|---|---|---:|---:|---:|",
        ]
        for name, sec in summary["sections"].items():
            n = {s: sum(i["status"] == s for i in sec["items"]) for s in (PASSED, FAILED, SKIPPED)}
            lines.append(f"| {name} | {sec['status']} | {n[PASSED]} | {n[FAILED]} | {n[SKIPPED]} |")
        for name in SECTIONS:
            items = [i for i in self.items if i.section == name]
            lines += ["", f"## {name}", ""]
            if not items:
                lines.append("Nothing ran in this section.")
                continue
            lines += ["| check | status | s | details |", "|---|---|---:|---|"]
            for i in items:
                # The recipes' figures are in their details already; summary.json has them all.
                figures = (
                    "; ".join(f"{k} {_fmt(v)}" for k, v in i.figures.items() if not isinstance(v, dict))
                    if name in FIGURE_SECTIONS
                    else ""
                )
                detail = " ".join(filter(None, [i.detail, f"({figures})" if figures else ""])).replace("|", "\\|")
                lines.append(
                    f"| {i.name} | {i.status.upper() if i.status == FAILED else i.status} | "
                    f"{i.seconds:.1f} | {detail} |"
                )
            if name == "environment" and self.env_text:
                lines += ["", "`python -m parallelx env`:", "", "```", self.env_text.rstrip(), "```"]
            for i in items:
                if i.status == FAILED and i.log:
                    # tqdm redraws with carriage returns: keep the last state of each line.
                    tail = "\n".join(row.rsplit("\r", 1)[-1] for row in i.log.splitlines()[-40:])
                    lines += ["", f"Output of the failed check *{i.name}* (last lines):", "", "```", tail, "```"]
        lines += [
            "",
            "Every launch's whole output: `logs.tar.gz` beside this report when the scratch folder was a "
            f"temporary one (no --work), else `{summary['logs']}`.",
            "",
            "Environment:",
            "",
            "```",
            json.dumps(self.facts, indent=1, default=str),
            "```",
            "",
        ]
        return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list) and value and all(isinstance(v, float) for v in value):
        return "[" + ", ".join(f"{v:.4g}" for v in value) + "]"
    return str(value)


def unavailable(backend: str) -> str | None:
    """Why ``backend`` cannot run here (None when it can), without importing its package."""
    import importlib

    from parallelx import describe
    from parallelx.launching import runner

    importlib.invalidate_caches()  # Horovod may have been installed since the last look
    return runner.unavailable(describe(backend))
