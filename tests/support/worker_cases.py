"""The ``main`` of a worker that runs named cases on one backend under a real launcher: the
programs, big-model and EMA workers' shared loop (``--out``, ``--cases``, each rank's report in
``<out>/rank<r>.json``, each case's time in it).  Under DeepSpeed, ``--stages 0 1 2`` runs the cases at
each of those ZeRO stages in turn, into ``<out>/zero<S>/``, in one launch: one process group, made
first, which each stage's backend adopts and leaves (one DeepSpeed start, its import and launcher
included, serves every stage: the tests' time, not their checks)."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import parallelx
from parallelx.errors import ParallelxError

#: A case: the backend and a folder of its own (``<out>/<case>``, shared by the ranks) -> its report.
Case = Callable[[parallelx.Backend, Path], dict[str, Any]]


def run_cases(worker: str, cases: Mapping[str, Case], *, refusals_reported: bool = False) -> int:
    """Run the ``--cases`` asked for (all by default), in order; with ``refusals_reported``, a case that
    raises a ``ParallelxError`` reports it (``{"error": ...}``) and the next case runs."""
    p = argparse.ArgumentParser()
    parallelx.add_arguments(p)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cases", default=",".join(cases))
    add_stages(p)
    args, _ = p.parse_known_args()
    for out, options in stage_runs(args):
        _run(worker, cases, args, out, refusals_reported, **options)
    return 0


def add_stages(parser: argparse.ArgumentParser) -> None:
    """The ``--stages`` option (see the module's docstring)."""
    parser.add_argument("--stages", type=int, nargs="+", help="under deepspeed: each of these ZeRO stages in turn")


def stage_runs(args: argparse.Namespace) -> Iterator[tuple[Path, dict[str, int]]]:
    """``(out folder, backend options)`` of each run of the launch: one into ``--out``, or, with
    ``--stages``, one per ZeRO stage into ``<out>/zero<S>``, in a process group made first."""
    if args.stages is None:
        yield args.out, {}
        return
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    for stage in args.stages:
        (args.out / f"zero{stage}").mkdir(parents=True, exist_ok=True)
        yield args.out / f"zero{stage}", {"zero_stage": stage}


def _run(
    worker: str,
    cases: Mapping[str, Case],
    args: argparse.Namespace,
    out: Path,
    refusals_reported: bool,
    **options: Any,
) -> int:
    backend = parallelx.from_args(args, **options)
    backend.init()
    report: dict[str, Any] = {}
    for name in args.cases.split(","):
        start = time.monotonic()
        (out / name).mkdir(parents=True, exist_ok=True)
        try:
            report[name] = cases[name](backend, out / name)
        except ParallelxError as exc:
            if not refusals_reported:
                raise
            report[name] = {"error": str(exc)}
        report[name]["seconds"] = round(time.monotonic() - start, 2)
        print(f"{worker}: rank {backend.rank}: {name}: {report[name]}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{backend.rank}.json").write_text(json.dumps(report, indent=1))
    backend.shutdown()
    return 0
