"""The runs of a check: which ones, started how, and what each left behind.

Every run is the user's unmodified script under a backend's own launcher
(:mod:`parallelx.launching.runner`), with ``--backend NAME`` added to its arguments and
the probe's variables (:mod:`parallelx.check.probe`) in its environment; it
stops by itself after the given number of optimizer steps.  Two more runs,
in one process each, are the reference (a virtual world of N ranks,
:mod:`parallelx.check.world`) and the noise floor (the reference again with
its initial weights perturbed at float32 rounding).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from parallelx.backend import OBSERVERS_ENV
from parallelx.check import probe as checkprobe
from parallelx.errors import ParallelxError
from parallelx.launching import runner
from parallelx.registry import available_backends, backend_class, describe

#: The backend of the reference and the floor: one process, one device.
REFERENCE_BACKEND = "single"
#: The floor run's perturbation of every initial weight: half a float32 rounding.
FLOAT32_HALF_ULP = 2.0**-24
#: The option by which a backend takes its sharding stage (the check runs each stage asked for).
STAGE_OPTION = "--zero-stage"
#: Seconds a finished rank waits for the others (an asymmetric script's rank may never come).
RANK_WAIT_S = 10.0


@dataclass(frozen=True)
class RunSpec:
    """One run: a label, the backend, what is added to the script's arguments."""

    label: str
    backend: str
    extra: tuple[str, ...] = ()
    nproc: int = 2
    #: The reference's virtual ranks (0: a real run).
    ranks: int = 0
    perturb: float = 0.0
    #: ``--tensor-parallel``'s degree in the script's arguments: each group of this many processes is
    #: one data-parallel rank, recorded once (by its tensor-parallel rank 0).
    tp: int = 1

    @property
    def real(self) -> bool:
        return self.ranks == 0

    @property
    def data_ranks(self) -> int:
        """The ranks that read their own data: the processes, or their tensor-parallel groups."""
        return self.nproc // self.tp


@dataclass
class RunResult:
    """What a run left: each rank's record, rank 0's tensors, how the launch ended."""

    spec: RunSpec
    seconds: float = 0.0
    returncode: int = 0
    timed_out: bool = False
    tail: str = ""
    warnings: list[str] = field(default_factory=list)
    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)
    grads: dict[str, torch.Tensor] | None = None
    weights: dict[str, torch.Tensor] | None = None
    #: Why this run cannot be used (None: it can).
    error: str | None = None
    #: How the launch failed after every rank had left its record (the records stay usable).
    launch_error: str | None = None

    @property
    def label(self) -> str:
        return self.spec.label

    @property
    def usable(self) -> bool:
        return self.error is None and 0 in self.ranks

    def rank0(self) -> dict[str, Any]:
        return self.ranks[0]

    def steps_done(self) -> dict[int, int]:
        return {r: int(rec.get("steps_done", len(rec.get("steps", [])))) for r, rec in self.ranks.items()}

    def step(self, rank: int, s: int) -> dict[str, Any] | None:
        for entry in self.ranks.get(rank, {}).get("steps", []):
            if entry["step"] == s:
                return entry
        return None

    def micro(self, rank: int, s: int) -> list[dict[str, Any]]:
        """Rank ``rank``'s training forwards of step ``s`` (the reference: virtual rank ``rank``'s)."""
        records = self.ranks.values() if not self.spec.real else [self.ranks.get(rank, {})]
        return [m for rec in records for m in rec.get("micro", []) if m["step"] == s and m["rank"] == rank]

    def losses(self, s: int) -> list[float]:
        return [e["loss"] for rec in self.ranks.values() for e in rec.get("losses", []) if e["step"] == s]

    def options(self) -> dict[str, Any]:
        return dict(self.rank0().get("options", {}))

    def n_ranks(self) -> int:
        return self.spec.ranks if not self.spec.real else self.spec.data_ranks


# ---------------------------------------------------------------- which runs
def accepts(backend: str, option: str) -> bool:
    """True when ``backend``'s own command-line options include ``option``."""
    parser = argparse.ArgumentParser(add_help=False)
    backend_class(backend).add_arguments(parser)
    _, rest = parser.parse_known_args([option, "0"])
    return not rest


def default_backends() -> list[str]:
    """Every installed multi-process backend, in the registry's order."""
    names = []
    for name in available_backends():
        if name == "auto":
            continue
        spec = describe(name)
        if spec.launcher.multi_process and runner.unavailable(spec) is None:
            names.append(name)
    return names


#: The options that split layers: the reference (one process) runs the script without them.
TENSOR_PARALLEL_OPTIONS = ("--tensor-parallel", "--sequence-parallel", "--loss-parallel")


def tensor_parallel_degree(target: Sequence[str]) -> int:
    """``--tensor-parallel N`` among the script's arguments (1 without it)."""
    for i, arg in enumerate(target):
        value = arg.split("=", 1)[1] if arg.startswith("--tensor-parallel=") else None
        if arg == "--tensor-parallel" and i + 1 < len(target):
            value = target[i + 1]
        if value is not None:
            try:
                return int(value)
            except ValueError:
                raise ParallelxError(f"--tensor-parallel takes a whole number, got {value!r}") from None
    return 1


def without_tensor_parallel(target: Sequence[str]) -> list[str]:
    """The script's arguments for the one-process reference: no layer is split there."""
    out, skip = [], False
    for arg in target:
        if skip:
            skip = False
            continue
        if arg == "--tensor-parallel":
            skip = True
            continue
        if arg in TENSOR_PARALLEL_OPTIONS[1:] or any(arg.startswith(f"{o}=") for o in TENSOR_PARALLEL_OPTIONS):
            continue
        out.append(arg)
    return out


def plan(backends: Sequence[str] | None, stages: Sequence[int], nproc: int, tp: int = 1) -> list[RunSpec]:
    """The real runs: each backend (a backend with stages once per stage), ``nproc`` processes each;
    under ``--tensor-parallel`` (``tp`` > 1) the backends that split layers, at the stages that do."""
    if nproc % tp:
        raise ParallelxError(
            f"--tensor-parallel {tp} must divide the check's --nproc {nproc}: give --nproc {tp} or {2 * tp}"
        )
    names = list(backends) if backends else [n for n in default_backends() if tp == 1 or describe(n).tensor_parallel]
    if not names:
        raise ParallelxError(
            "no multi-process backend is installed here; `python -m parallelx env` says why each is unavailable"
        )
    known = [n for n in available_backends() if n != "auto"]
    specs: list[RunSpec] = []
    for name in names:
        if name not in known:
            raise ParallelxError(f"--backends: unknown backend {name!r}; valid backends are: {', '.join(known)}")
        described = describe(name)
        if not described.launcher.multi_process:
            raise ParallelxError(
                f"--backends: {name} runs one process; the check compares multi-process backends with its own "
                "one-process reference (leave it out)"
            )
        if tp > 1 and not described.tensor_parallel:
            raise ParallelxError(
                f"--backends: {name} cannot split layers (the script's --tensor-parallel {tp}); check it on the "
                "backends that do (ddp, fsdp, deepspeed), or check the script without --tensor-parallel"
            )
        reason = runner.unavailable(described)
        if reason is not None:
            raise ParallelxError(f"--backends: {name} cannot run here: {reason}")
        if stages and accepts(name, STAGE_OPTION):
            specs += [RunSpec(f"{name}-zero{z}", name, (STAGE_OPTION, str(z)), nproc, tp=tp) for z in stages]
        else:
            specs.append(RunSpec(name, name, (), nproc, tp=tp))
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise ParallelxError(f"--backends names a backend twice: {', '.join(names)}")
    return specs


def reference_specs(ranks: int) -> tuple[RunSpec, RunSpec]:
    """The one-process reference and its floor, playing ``ranks`` data-parallel ranks."""
    return (
        RunSpec("reference", REFERENCE_BACKEND, (), 1, ranks=ranks),
        RunSpec("floor", REFERENCE_BACKEND, (), 1, ranks=ranks, perturb=FLOAT32_HALF_ULP),
    )


# ---------------------------------------------------------------- running them
WARNING = re.compile(r"parallelx: warning: (.*)")
PREFIX = re.compile(r"^(\[\d+\](<std(out|err)>)?:|\[rank\d+\]:|\[default\d+\]:)\s*")


def run_one(
    spec: RunSpec,
    target: Sequence[str],
    folder: Path,
    *,
    steps: int,
    timeout: float,
    cwd: str | os.PathLike[str] | None = None,
    collective_timeout: float | None = None,
) -> RunResult:
    """Launch ``target`` as ``spec`` says and read what its ranks recorded."""
    out = folder / spec.label
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = {
        OBSERVERS_ENV: "parallelx.check.probe:attach",  # Backend.init attaches the probe
        checkprobe.ENV_DIR: str(out),
        checkprobe.ENV_STEPS: str(steps),
        checkprobe.ENV_RANKS: str(spec.ranks),
        checkprobe.ENV_PERTURB: repr(spec.perturb),
        checkprobe.ENV_WAIT: str(RANK_WAIT_S),
    }
    if "PARALLELX_TIMEOUT" not in os.environ:
        # A stalled collective ends within the run's time, and sooner where the reference's time says so.
        env["PARALLELX_TIMEOUT"] = str(int(collective_timeout) if collective_timeout else max(30, int(timeout)))
    # The reference splits no layer: one process computes what every tensor-parallel group computes.
    argv = [*(target if spec.real else without_tensor_parallel(target)), "--backend", spec.backend, *spec.extra]
    done = runner.launch(describe(spec.backend).launcher, argv, spec.nproc, timeout=timeout, env=env, cwd=cwd)
    result = RunResult(spec, seconds=done.seconds, returncode=done.returncode, timed_out=done.timed_out)
    result.tail = done.tail(40)
    result.warnings = sorted({m.group(1).strip() for ln in done.output.splitlines() if (m := WARNING.search(ln))})
    for path in sorted(out.glob("rank*.json")):
        record = json.loads(path.read_text())
        result.ranks[int(record["rank"])] = record
    if (out / "grads.pt").is_file():
        result.grads = torch.load(out / "grads.pt", weights_only=True)
    if (out / "weights.pt").is_file():
        result.weights = torch.load(out / "weights.pt", weights_only=True)
    result.error = _why_unusable(result, done.error(), done.output)
    return result


def _why_unusable(result: RunResult, launch_error: str | None, output: str) -> str | None:
    spec = result.spec
    if not result.ranks:
        if launch_error is None:
            return (
                "it recorded nothing: the script never initialised a parallelx backend (does it call "
                "parallelx.from_args(args) or backend.init()?)"
            )
        return f"{launch_error}; {last_error_line(output)}"
    ran = result.rank0().get("backend")
    if ran != spec.backend:
        return (
            f"the script ran on {ran!r}, not {spec.backend!r}: it must take --backend "
            "(parallelx.add_arguments(parser) and parallelx.from_args(args))"
        )
    missing = [r for r in range(spec.data_ranks) if r not in result.ranks]
    if missing:
        why = launch_error or "it ended"
        return f"{why}; rank(s) {', '.join(map(str, missing))} recorded nothing; {last_error_line(output)}"
    if launch_error is not None and not any(result.steps_done().values()):
        # It failed before any rank took a step: nothing of it to compare, and the error is the finding
        # (a tensor-parallel group whose ranks read different batches stops at the first forward).
        return f"{launch_error}; {last_error_line(output)}"
    if launch_error is not None:
        # Every rank recorded what it saw; the failure came after (a rank left waiting in a collective).
        result.launch_error = f"{launch_error}; {last_error_line(output)}"
    return None


#: Exceptions of the launchers themselves, which only say that a worker failed.
LAUNCHER_ERRORS = ("ChildFailedError", "CalledProcessError", "torch.distributed.elastic", "horovod.runner")


#: The verdict every rank prints when the ranks part ways (parallelx.forensics.exchange).
VERDICT = re.compile(r"parallelx: verdict \(rank \d+\): (.*)")


def collective_timeout(reference: RunResult, nproc: int, timeout: float) -> float:
    """The collective timeout of the check's real runs: twice the one-process reference's own time from
    its set-up to its last step (so surely more than one step; the whole run where it recorded none) for
    each of ``nproc`` processes sharing the machine, at least 30 s (a slow rank's set-up) and at most
    ``timeout``: a script whose ranks part ways is diagnosed in a minute or two, not after the script's
    own timeout (30 minutes by default)."""
    steps = reference.rank0().get("steps") if 0 in reference.ranks else None
    span = float(steps[-1]["seconds"]) if steps else reference.seconds
    return min(float(timeout), max(30.0, 2.0 * nproc * span))


def last_error_line(output: str) -> str:
    """The line of a failed run's output that says why: the script's first
    exception (the others are usually its consequences on the other ranks;
    not the launcher's report of it), else the last line."""
    lines = [PREFIX.sub("", ln).strip() for ln in output.splitlines()]
    lines = [ln for ln in lines if ln]
    # Every rank's verdict of a hang or a failed rank names the rank, the call and the line (docs/hangs.md).
    verdicts = [m.group(1) for ln in lines if (m := VERDICT.search(ln))]
    if verdicts:
        return verdicts[0]
    errors = [ln for ln in lines if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", ln) or ln.startswith("error:")]
    own = [ln for ln in errors if not any(k in ln for k in LAUNCHER_ERRORS)]
    if own:
        return own[0]
    if errors:
        return errors[-1]
    return lines[-1] if lines else "no output"


def run_all(
    specs: Sequence[RunSpec],
    target: Sequence[str],
    folder: Path,
    *,
    steps: int,
    timeout: float,
    cwd: str | os.PathLike[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[RunResult, RunResult, list[RunResult]]:
    """The reference and the floor (side by side: one process each), then every real run in turn."""
    reference, floor = reference_specs(specs[0].data_ranks if specs else 2)
    results: dict[str, RunResult] = {}

    sized: list[float] = []

    def go(spec: RunSpec) -> None:
        limit = sized[0] if sized else None
        results[spec.label] = run_one(
            spec, target, folder, steps=steps, timeout=timeout, cwd=cwd, collective_timeout=limit
        )

    if progress:
        progress("the one-process reference and its noise floor")
    side = threading.Thread(target=go, args=(floor,), daemon=True)
    side.start()
    go(reference)
    side.join()
    if results["reference"].error is None:
        sized.append(collective_timeout(results["reference"], max((s.nproc for s in specs), default=2), timeout))
    real = []
    for spec in specs:
        if progress:
            progress(spec.label)
        go(spec)
        real.append(results[spec.label])
    return results["reference"], results["floor"], real
