"""``python -m parallelx.launching.ray_train``: run a parallelx script as a Ray Train job.

    python -m parallelx.launching.ray_train -n 2 -m recipes.cifar10 --backend ddp --data-dir data/cifar10 --resume auto
    python -m parallelx.launching.ray_train -n 4 --gpu --max-failures 3 recipes/cifar10.py --backend deepspeed ...

One ``TorchTrainer`` with ``ScalingConfig(num_workers=N)``; each worker runs
the script's ``__main__`` with the arguments given, in this directory (which
every node must have at the same path, with the package importable).  Ray
makes the process group first; the script's backend adopts it
(:mod:`parallelx.launching.environments.ray_worker`), reports every training-state checkpoint
to Ray and, when Ray replaces a failed worker group (``--max-failures``),
resumes from the latest one: give the script ``--resume auto`` (or its own
equivalent).  ``--timeout`` is the process group's (``TorchConfig``): the
backend's own ``--timeout`` cannot reach a group Ray made.

Connects to a running cluster when ``--address`` (``auto``: the one this
machine belongs to) or ``RAY_ADDRESS`` names one, else starts a new local one
with just the CPUs the workers need.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from parallelx.errors import ParallelxError

#: Variables the workers get from this process besides Ray's own: parallelx's,
#: and those named with --env.
_PASSED_PREFIXES = ("PARALLELX_",)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m parallelx.launching.ray_train",
        description=__doc__.split("\n\n")[0],
        usage="%(prog)s [options] (-m MODULE | SCRIPT) [ARGS ...]",
    )
    p.add_argument("-n", "--num-workers", type=int, default=2, help="Ray Train workers, one rank each (default 2)")
    p.add_argument("--gpu", action="store_true", help="one GPU per worker (NCCL); default: the CPU (Gloo)")
    p.add_argument("--cpus-per-worker", type=float, default=1.0, help="CPUs Ray reserves per worker (default 1)")
    p.add_argument(
        "--max-failures",
        type=int,
        default=0,
        help="times Ray replaces a failed worker group, which then resumes (default 0)",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="the process group's timeout in s (default 1800)")
    p.add_argument(
        "--storage",
        type=Path,
        default=None,
        help="where Ray keeps the reported checkpoints (shared by every node; default ~/ray_results)",
    )
    p.add_argument("--name", default=None, help="the run's name under --storage (default: parallelx-<time>)")
    p.add_argument("--keep-checkpoints", type=int, default=2, help="checkpoints Ray keeps (default 2)")
    p.add_argument(
        "--address",
        default=None,
        help="a running Ray cluster, or auto for this machine's (default: $RAY_ADDRESS, else a new local one)",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME",
        help="pass this variable of the driver's environment to the workers (repeatable)",
    )
    return p


def split_argv(argv: Sequence[str]) -> tuple[list[str], str, str, list[str]]:
    """``(launcher options, "module" or "file", target, script arguments)``:
    the script starts at ``-m MODULE`` or at the first word that is no option's."""
    takes_value = {
        a
        for action in build_parser()._actions
        if action.nargs is None and action.option_strings
        for a in action.option_strings
    }
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "-m":
            if i + 1 >= len(argv):
                break
            return list(argv[:i]), "module", argv[i + 1], list(argv[i + 2 :])
        if not word.startswith("-"):
            return list(argv[:i]), "file", word, list(argv[i + 1 :])
        i += 2 if word in takes_value else 1
    raise ParallelxError(
        "python -m parallelx.launching.ray_train: give the script to run, as -m MODULE or SCRIPT, after the options"
    )


def run_target(config: dict[str, Any]) -> None:
    """Ray Train's worker function: the script's ``__main__``, as ``python`` would run it."""
    os.chdir(config["cwd"])
    sys.path[:0] = [p for p in config["path"] if p not in sys.path]
    sys.argv = [config["target"], *config["args"]]
    try:
        if config["kind"] == "module":
            runpy.run_module(config["target"], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(config["target"], run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            # A failure for Ray: with --max-failures it starts the worker group again.
            raise RuntimeError(f"{config['target']} exited with status {exc.code}") from None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        build_parser().print_help()
        return 0 if argv else 2
    try:
        options, kind, target, args = split_argv(argv)
    except ParallelxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    opts = build_parser().parse_args(options)
    try:
        import ray
        from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
    except ImportError as exc:
        print(f"error: Ray Train does not import ({exc}); pip install 'parallelx[ray]'", file=sys.stderr)
        return 2
    cwd = os.getcwd()
    path = [cwd, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    passed = {k: v for k, v in os.environ.items() if k.startswith(_PASSED_PREFIXES) or k in opts.env}
    passed["PYTHONPATH"] = os.pathsep.join(path)
    started = False
    if not ray.is_initialized():
        address = opts.address or os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, runtime_env={"env_vars": passed})
        else:  # a local cluster sized for the workers; no dashboard (seconds of start-up, a port)
            ray.init(
                address="local",
                num_cpus=max(1, int(opts.num_workers * opts.cpus_per_worker + 0.999)),
                num_gpus=opts.num_workers if opts.gpu else 0,
                include_dashboard=False,
                runtime_env={"env_vars": passed},
            )
            started = True
    resources = {"CPU": opts.cpus_per_worker, **({"GPU": 1} if opts.gpu else {})}
    trainer = TorchTrainer(
        run_target,
        train_loop_config={"cwd": cwd, "path": path, "kind": kind, "target": target, "args": args},
        scaling_config=ScalingConfig(num_workers=opts.num_workers, use_gpu=opts.gpu, resources_per_worker=resources),
        torch_config=TorchConfig(timeout_s=int(opts.timeout)),
        run_config=RunConfig(
            name=opts.name or f"parallelx-{time.strftime('%Y%m%d-%H%M%S')}",
            storage_path=None if opts.storage is None else str(opts.storage.resolve()),
            failure_config=FailureConfig(max_failures=opts.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=opts.keep_checkpoints),
        ),
    )
    try:
        result = trainer.fit()
    except Exception as exc:  # Ray's TrainingFailedError, with the worker's error inside
        last = (str(exc).strip().splitlines() or [""])[-1]
        print(f"error: the Ray Train run failed: {type(exc).__name__}: {last}", file=sys.stderr)
        return 1
    finally:
        if started:
            ray.shutdown()
    where = result.checkpoint.path if result.checkpoint is not None else "none"
    print(f"ray: {target} done on {opts.num_workers} workers; latest checkpoint reported: {where}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
