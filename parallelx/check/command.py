"""The check's command line and its Python entry point."""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from parallelx.check.analysis import Analysis
from parallelx.check.report import Report
from parallelx.check.runs import STAGE_OPTION, accepts, plan, run_all, tensor_parallel_degree
from parallelx.errors import ParallelxError

DEFAULT_STAGES = (0, 3)
DEFAULT_STEPS = 3
DEFAULT_TIMEOUT_S = 600.0


def check_script(
    script: str | Sequence[str],
    *args: str,
    backends: Sequence[str] | None = None,
    stages: Sequence[int] = DEFAULT_STAGES,
    nproc: int = 2,
    steps: int = DEFAULT_STEPS,
    rtol: float | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    cwd: str | Path | None = None,
    keep: str | Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> Report:
    """Run ``script`` (``"train.py"``, ``"-m pkg.train"`` or an argv list) with
    ``args`` on every backend asked for (default: every installed
    multi-process backend, DeepSpeed at each of ``stages``) and in one
    process, and return the :class:`~parallelx.check.Report`.

    ``report.exit_code`` is 0 when everything agrees within the measured
    tolerance, 1 when something differs (``report.differences()`` says what
    and how to fix it), 2 when a run could not be used.  ``rtol`` sets the
    least tolerance (default: 16 float32 roundings, or the autocast type's
    rounding under mixed precision); ``timeout`` bounds each run, in seconds;
    ``keep`` keeps every run's records in that folder.  With ``--tensor-parallel N`` among the
    script's arguments, each backend that splits layers runs it so (``nproc`` processes, N to a
    group) and the reference, one process without it, plays the ``nproc / N`` data-parallel ranks.
    """
    target = _target(script, args, cwd)
    if nproc < 2:
        raise ParallelxError(f"nproc must be >= 2 (the check compares ranks and backends), got {nproc}")
    if steps < 1:
        raise ParallelxError(f"steps must be >= 1, got {steps}")
    if rtol is not None and not rtol > 0:
        raise ParallelxError(f"rtol must be a number > 0, got {rtol}")
    if any(s < 0 for s in stages):
        raise ParallelxError(f"stages must be >= 0, got {list(stages)}")
    tp = tensor_parallel_degree(target)
    if tp > 1 and 3 in stages:  # ZeRO-3 does not split layers (docs/tensor-parallel.md); ZeRO-2 does
        stages = sorted({2 if s == 3 else s for s in stages})
        if progress and (backends is None or any(accepts(b, STAGE_OPTION) for b in backends)):
            progress(f"ZeRO-3 does not take --tensor-parallel: ZeRO stages {','.join(map(str, stages))} instead")
    specs = plan(backends, stages, nproc, tp)
    start = time.monotonic()
    folder = Path(keep) if keep is not None else Path(tempfile.mkdtemp(prefix="parallelx-check-"))
    try:
        reference, floor, runs = run_all(
            specs, target, folder, steps=steps, timeout=timeout, cwd=cwd, progress=progress
        )
    finally:
        if keep is None:
            shutil.rmtree(folder, ignore_errors=True)
    shown = target if target[0] == "-m" else [target[0], *target[1:]]
    analysis = Analysis(
        shown,
        reference,
        floor,
        runs,
        nproc=nproc // tp,
        steps=steps,
        rtol=rtol,
        seconds=time.monotonic() - start,
        tensor_parallel=tp,
    )
    return analysis.report()


def _target(script: str | Sequence[str], args: Sequence[str], cwd: str | Path | None) -> list[str]:
    words = (
        list(script) if not isinstance(script, str) else shlex.split(script) if script.startswith("-m ") else [script]
    )
    target = [*words, *args]
    if not target:
        raise ParallelxError("nothing to check: give the script, e.g. `-- train.py --lr 0.1` or `-- -m pkg.train`")
    if target[0] == "-m":
        if len(target) < 2:
            raise ParallelxError("`-m` needs a module name: `-- -m package.module ARGS...`")
    else:
        path = Path(cwd or ".") / target[0]
        if not path.is_file():
            raise ParallelxError(
                f"the script {target[0]} does not exist (relative to {Path(cwd or '.').resolve()}); "
                "give a file, or `-m package.module`"
            )
    if "--backend" in target[1:] or any(a.startswith("--backend=") for a in target[1:]):
        raise ParallelxError("leave --backend out of the script's arguments: the check runs every backend itself")
    return target


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backends",
        default=None,
        metavar="LIST",
        help="comma-separated backends to check (default: every installed multi-process backend)",
    )
    parser.add_argument(
        "--zero-stages",
        dest="stages",
        default=",".join(map(str, DEFAULT_STAGES)),
        metavar="LIST",
        help="the stages of a backend that takes --zero-stage (DeepSpeed's ZeRO), each a run of its own (default 0,3)",
    )
    parser.add_argument("--nproc", type=int, default=2, help="processes per run (default 2)")
    parser.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help=f"optimizer steps each run takes (default {DEFAULT_STEPS})"
    )
    parser.add_argument(
        "--rtol",
        type=float,
        default=None,
        help="the least relative tolerance (default: 16 float32 roundings; the autocast type's rounding under "
        "mixed precision); each tensor's is 10 x its measured noise floor when that is larger",
    )
    parser.add_argument("--report", default=None, metavar="JSON", help="also write the report to this file")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds each run may take (default {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument("--keep", default=None, metavar="DIR", help="keep every run's records in DIR")


def main(args: argparse.Namespace, target: list[str]) -> int:
    """``python -m parallelx check``: print the report, return its exit status."""
    try:
        stages = [int(s) for s in args.stages.split(",") if s.strip()] if args.stages else []
    except ValueError:
        raise ParallelxError(f"--zero-stages must be a comma-separated list of integers, got {args.stages!r}") from None
    backends = [b.strip() for b in args.backends.split(",") if b.strip()] if args.backends else None

    def progress(what: str) -> None:
        print(f"check: running {what}", file=sys.stderr, flush=True)

    report = check_script(
        target,
        backends=backends,
        stages=stages,
        nproc=args.nproc,
        steps=args.steps,
        rtol=args.rtol,
        timeout=args.timeout,
        keep=args.keep,
        progress=progress,
    )
    print(report.render(), end="", flush=True)
    if args.report:
        report.write(args.report)
    return report.exit_code
