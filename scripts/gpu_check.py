"""The GPU check's command (``gpu_check/`` beside it is the check): its options and the order of its sections.

    .venv/bin/python scripts/gpu_check.py --dry-run --out /tmp/gpu-report   # here; on the GPU: gpu_check.sh

It also starts the check's own helper processes (``--worker sync``, ``--build-horovod``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path

# The package, not this file: a script's folder is first on sys.path, and a package wins over a module.
from gpu_check import __doc__ as ABOUT
from gpu_check.check import BACKENDS, BUDGET_S, CUDA, DRY_RUN, FAILED, PASSED, ROOT, SECTIONS, SKIPPED, Item
from gpu_check.sections import GpuCheck, install_wheels, kill_group
from gpu_check.workers import build_horovod, sync_worker


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=ABOUT.splitlines()[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="CPU mode: everything except what needs CUDA (CI runs this)"
    )
    parser.add_argument(
        "--out",
        default=os.environ.get("OUT") or str(ROOT / "gpu-report"),
        help="where report.md and summary.json go (default $OUT, else gpu-report/)",
    )
    parser.add_argument(
        "--work",
        default=None,
        help="scratch folder for data, runs and logs, kept afterwards "
        "(default: a temporary one, its logs packed beside the report)",
    )
    parser.add_argument(
        "--deadline", type=float, default=None, help=f"Unix time by which to finish (default: {BUDGET_S:.0f}s from now)"
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="processes per multi-process launch (default: the GPUs; 2 in the dry run)",
    )
    parser.add_argument(
        "--only",
        type=lambda s: s.split(","),
        default=list(SECTIONS),
        help=f"comma-separated sections to run ({','.join(SECTIONS)})",
    )
    parser.add_argument(
        "--wheels",
        type=Path,
        default=None,
        help="install these carried wheels first (gpu_check.sh: gpu-wheels/); Horovod's sdist there is built with NCCL",
    )
    parser.add_argument("--site", type=Path, default=Path("gpu-site"), help="where --wheels go (default gpu-site/)")
    for hidden in ("--plan", "--build-horovod", "--wheel-dir"):  # the workers'
        parser.add_argument(hidden, type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=["sync"], help=argparse.SUPPRESS)
    # The deepspeed launcher appends --local_rank=N to a worker's arguments.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if unknown := set(args.only) - set(SECTIONS):
        parser.error(f"--only: unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    return args


def _on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the runner (which kills the running launch) to the report


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker == "sync":
        return sync_worker(args.plan)
    if args.build_horovod is not None:
        return build_horovod(args.build_horovod, args.wheel_dir)
    installed = install_wheels(args.wheels, args.site) if args.wheels is not None else None
    try:
        import torch

        import parallelx  # noqa: F401
    except ImportError as exc:
        print(
            f"error: parallelx is not importable with {sys.executable} ({exc}); on the GPU machine run "
            "`bash scripts/gpu_check.sh`, here `make setup`",
            file=sys.stderr,
        )
        if installed is not None and installed.status == FAILED:
            print(f"the carried wheels did not install: {installed.detail}\n{installed.log or ''}", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print(
            "error: no CUDA device is visible; on a machine without one run the CPU mode: "
            "scripts/gpu_check.py --dry-run",
            file=sys.stderr,
        )
        return 2
    check = GpuCheck(args, CUDA if cuda else DRY_RUN, args.nproc or (torch.cuda.device_count() if cuda else 2))
    signal.signal(signal.SIGTERM, _on_sigterm)
    sys.path.append(str(check.pythonpath))  # benchmarks and the top-level recipes, without the checkout's root
    print(
        f"[gpu-check] {'CUDA' if cuda else 'dry run on the CPU'}, {check.nproc} process(es) per launch, "
        f"{check.remaining():.0f}s budget; work in {check.work}; report in {check.out}",
        flush=True,
    )
    try:
        if installed is None:
            check.skip("install", "carried wheels", "no --wheels (gpu_check.sh passes gpu-wheels/): nothing installed")
        else:
            check.record(installed)
        check.start_horovod_build()  # first: it has the longest way to go
        check.environment()
        check.make_data()
        early = [b for b in BACKENDS if b != "horovod" or check.horovod_build is None]
        check.recipes("cifar10", early)
        check.throughput()
        check.fsdp()
        check.host_sync(early)
        check.recipes("dogcat", early)
        check.transformers()  # before Horovod's checks, to give its build more time
        if check.horovod_build is not None:
            check.finish_horovod_build(check.horovod_build)
            check.recipes("cifar10", ["horovod"])
            check.recipes("dogcat", ["horovod"])
            check.host_sync(["horovod"])
    except (SystemExit, KeyboardInterrupt) as exc:
        check.record(Item("install", "the check itself", FAILED, f"interrupted ({exc!r}) before it finished"))
    finally:
        if check.horovod_build is not None and check.horovod_build.poll() is None:
            kill_group(check.horovod_build)
        check.write()
        if args.work is None:  # our own temporary folder: its logs beside the report, its 0.5 GB checkpoints gone
            with tarfile.open(check.out / "logs.tar.gz", "w:gz") as tar:
                tar.add(check.logs, arcname="logs")
            shutil.rmtree(check.work, ignore_errors=True)
    summary = check.summary()
    c = summary["counts"]
    print(
        f"[gpu-check] {summary['result'].upper()}: {c[PASSED]} passed, {c[FAILED]} failed, {c[SKIPPED]} skipped "
        f"in {summary['seconds']:.0f}s; {check.out / 'report.md'}",
        flush=True,
    )
    return 0 if summary["result"] == PASSED else 1


if __name__ == "__main__":
    sys.exit(main())
