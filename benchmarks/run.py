"""Run the benchmark: every available backend, through parallelx and through
its plain hand-written script, side by side on one machine (benchmarks/README.md).

What runs is planned in ``plan.py``, started in ``launch.py``, summarised in
``stats.py`` and written by ``report.py``.  The exit status is 1 when a launch
failed or final weights differ between parallelx and the plain script.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmarks import launch, plan, report, stats, tracking
from benchmarks.workload import BenchError
from parallelx.cli import exit_on_error, positive_int
from parallelx.launching import envreport

ROOT = Path(__file__).resolve().parents[1]
#: The cost of trackers and throughput accounting (benchmarks/tracking.py): run only when named in --only.
TRACKING = "tracking"


def add_common(p: argparse.ArgumentParser, *, out_dir: Path, raw: Path, timeout: float | None) -> None:
    """The options ``benchmarks.run`` and ``benchmarks.loops`` share."""
    p.add_argument("--nproc", type=int, default=None, help="processes per distributed run (default: GPUs, else 2)")
    p.add_argument(
        "--no-bind",
        dest="bind_cores",
        action="store_false",
        help="leave the CPU processes unpinned (default: each on its own cores)",
    )
    p.add_argument("--timeout", type=float, default=timeout, help="seconds per launch before it is killed")
    p.add_argument("--out-dir", type=Path, default=out_dir, help="results.md, summary.json (default: %(default)s)")
    p.add_argument("--raw", type=Path, default=raw, help="every step time as JSON (default: %(default)s)")
    p.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="logs, plans and results of every launch, kept (default: a temp dir, kept if one failed)",
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--mode", choices=sorted(plan.PRESETS), default="quick")
    p.add_argument(
        "--only",
        default=",".join(plan.PARTS),
        help=f"comma-separated parts to run (default: all of {','.join(plan.PARTS)}; also: {TRACKING})",
    )
    p.add_argument("--models", default="lenet,vgg16", help="comma-separated: lenet, vgg16")
    p.add_argument("--image-size", type=int, default=None, help="VGG16 image size (default: the mode's)")
    p.add_argument("--repeats", type=positive_int, default=None, help="rounds of alternating launches")
    p.add_argument(
        "--control",
        nargs="?",
        const="all",
        default="",
        metavar="FAMILIES",
        help="also run each plain script (or those of the comma-separated families) a second time "
        "and compare it with itself: the noise floor",
    )
    p.add_argument(
        "--blocks",
        type=positive_int,
        default=None,
        help="same-process part: alternating blocks of each implementation (default: the mode's)",
    )
    p.add_argument("--steps", type=positive_int, default=None, help="timed LeNet steps per launch")
    add_common(p, out_dir=ROOT / "benchmarks" / "results", raw=ROOT / "runs" / "bench" / "results.json", timeout=None)
    args = p.parse_args(argv)
    args.parts, args.model_list = [x for x in args.only.split(",") if x], [x for x in args.models.split(",") if x]
    args.control = list(plan.FAMILIES) if args.control == "all" else [x for x in args.control.split(",") if x]
    if bad := [x for x in args.control if x not in plan.FAMILIES]:
        p.error(f"--control: unknown {', '.join(bad)}; choose from {', '.join(plan.FAMILIES)}")
    parts = (*plan.PARTS, TRACKING)
    for option, given, valid in (("--only", args.parts, parts), ("--models", args.model_list, ("lenet", "vgg16"))):
        if bad := [x for x in given if x not in valid]:
            p.error(f"{option}: unknown {', '.join(bad)}; choose from {', '.join(valid)}")
    return args


def preset_from(args: argparse.Namespace) -> plan.Preset:
    fields = {
        "image_size": args.image_size,
        "repeats": args.repeats,
        "same_blocks": args.blocks,
        "lenet_steps": args.steps,
        "timeout_s": args.timeout,
    }
    preset = replace(plan.PRESETS[args.mode], **{k: v for k, v in fields.items() if v is not None})
    if preset.image_size < 32:
        raise BenchError(f"--image-size {preset.image_size} is too small for VGG16; use at least 32")
    return preset


class Session:
    """What both command lines do around their launches: the SIGTERM handler
    (a timeout from outside still writes the results), the machine, the
    skipped parts said on stderr, the work dir, and the results' ``meta``."""

    def __init__(self, args: argparse.Namespace, argv: list[str] | None, module: str, tag: str) -> None:
        signal.signal(signal.SIGTERM, launch.on_sigterm)
        self.args, self.tag, self.started, self.load_start = args, tag, time.time(), os.getloadavg()
        self.command = f"python -m {module} " + shlex.join(argv if argv is not None else sys.argv[1:])
        self.machine = plan.detect_machine(args.nproc, bind_cores=args.bind_cores)
        self.work = args.work_dir or Path(tempfile.mkdtemp(prefix=f"parallelx-{tag}-"))
        self.work.mkdir(parents=True, exist_ok=True)

    def drop_skipped(self, names: list[str], skipped: dict[str, str]) -> list[str]:
        for name, why in skipped.items():
            print(f"[{self.tag}] skipping {name}: {why}", file=sys.stderr)
        return [n for n in names if n not in skipped]

    def finish(self, jobs: list[plan.Job], failures: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """Remove a temporary work dir unless a launch failed (then its logs stay); the results' ``meta``."""
        if self.args.work_dir is None:
            if failures:
                print(f"[{self.tag}] keeping the logs of the failed run in {self.work}", file=sys.stderr)
            else:
                shutil.rmtree(self.work, ignore_errors=True)
        m = self.machine
        return {
            "command": self.command,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(self.started)),
            "wall_s": round(time.time() - self.started, 1),
            **extra,
            "load_average_start": self.load_start,
            "load_average_end": os.getloadavg(),
            "hardware": envreport.hardware(),
            "versions": envreport.versions(),
            "machine": asdict(m),
            "launches": [{"job": j.tag, "seconds": round(j.seconds, 1), "ok": j.error is None} for j in jobs],
        }


@exit_on_error
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    preset = preset_from(args)
    if TRACKING in args.parts:  # asked for by name only: one process, its own results (benchmarks/tracking.py)
        rc = tracking.main(["--blocks", str(max(preset.same_blocks, 20)), "--out-dir", str(args.out_dir / "tracking")])
        args.parts.remove(TRACKING)
        if not args.parts:
            return rc
    session = Session(args, argv, "benchmarks.run", "bench")
    machine, work = session.machine, session.work
    if machine.gpus == 0 and machine.nproc > machine.cores:
        print(
            f"[bench] warning: {machine.nproc} processes on {machine.cores} core(s) oversubscribe the CPU",
            file=sys.stderr,
        )
    skipped = {part: why for part in args.parts if part in plan.FAMILIES and (why := launch.unavailable(part))}
    parts = session.drop_skipped(args.parts, skipped)
    print(
        f"[bench] mode {args.mode}: {machine.nproc} processes x {machine.threads_n} thread(s) "
        f"(1-process runs: {machine.threads_1}), {machine.comm}, "
        f"{'pinned to cores' if machine.bind_cores else 'not pinned'}; work dir {work}",
        flush=True,
    )
    # The same-process part needs each backend's package and launcher, whether or not its own part runs.
    same = tuple(f for f in plan.FAMILIES if launch.unavailable(f) is None) if "same-process" in parts else ()
    jobs = plan.schedule(preset, parts, args.model_list, machine, control=args.control, same_process=same)
    try:
        for job in jobs:
            launch.run_job(job, machine, work, preset.timeout_s)
        rows = stats.collect(jobs, work)
        comparisons = stats.overheads(rows, jobs, work) + stats.same_process_jobs(jobs, work)
    finally:
        for path in (work / "out").glob("*/*.weights.pt"):  # compared; large (VGG16: 0.5 GB per run)
            path.unlink()
    failures = [{"job": j.tag, "error": j.error} for j in jobs if j.error]
    meta = session.finish(
        jobs,
        failures,
        mode=args.mode,
        preset=asdict(preset),
        parts=parts,
        control=args.control,
        models=args.model_list,
        skipped=skipped,
        weight_tolerance=stats.WEIGHT_ATOL,
        ratio_target=stats.RATIO_TARGET,
    )
    result = {
        "meta": meta,
        "runs": rows,
        "comparisons": comparisons,
        "scaling": stats.scaling(rows),
        "failures": failures,
    }
    report.write(result, args.out_dir, args.raw, report.markdown(result), report.summary(result))
    print(f"[bench] done in {meta['wall_s']:.0f}s: {args.out_dir}/results.md, summary.json, {args.raw}", flush=True)
    bad = [c for c in comparisons if c["max_abs_weight_diff"] is not None and not c["weights_passed"]]
    for c in bad:
        print(
            f"[bench] WEIGHTS DIFFER: {c['impl']} vs {c['baseline']} ({c['how']}) on {c['case_id']} "
            f"(n={c['nproc']}): max |diff| {c['max_abs_weight_diff']:.3g} > {stats.WEIGHT_ATOL}",
            file=sys.stderr,
        )
    return 1 if failures or bad else 0


if __name__ == "__main__":
    sys.exit(main())
