"""The ``main`` of a worker that runs named cases on one backend under a real launcher: the
programs, big-model and EMA workers' shared loop (``--out``, ``--cases``, each rank's report in
``<out>/rank<r>.json``, each case's time in it)."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Mapping
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
    args, _ = p.parse_known_args()
    backend = parallelx.from_args(args)
    backend.init()
    report: dict[str, Any] = {}
    for name in args.cases.split(","):
        start = time.monotonic()
        (args.out / name).mkdir(parents=True, exist_ok=True)
        try:
            report[name] = cases[name](backend, args.out / name)
        except ParallelxError as exc:
            if not refusals_reported:
                raise
            report[name] = {"error": str(exc)}
        report[name]["seconds"] = round(time.monotonic() - start, 2)
        print(f"{worker}: rank {backend.rank}: {name}: {report[name]}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{backend.rank}.json").write_text(json.dumps(report, indent=1))
    backend.shutdown()
    return 0
