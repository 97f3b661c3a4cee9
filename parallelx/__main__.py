"""Command line of parallelx itself.

python -m parallelx env                         # what is installed here, which backends can run
python -m parallelx env --network               # on each machine: can it reach MASTER_ADDR:MASTER_PORT, over which interface
python -m parallelx launchers                   # the table of backends and their launch lines
python -m parallelx launch ddp -n 2 -- -m recipes.cifar10 --data-dir data/cifar10
                                                # start N local processes with the backend's own launcher
python -m parallelx convert-checkpoint RUN_DIR/checkpoints/step-00000120 model.pt
                                                # a sharded checkpoint as one portable file
python -m parallelx check -- train.py ARGS      # the same numbers on every backend? (docs/check.md)
python -m parallelx estimate MODULE:FUNCTION --world-sizes 2,4,8
                                                # memory per rank on each backend, the model built on meta
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from parallelx import storage
from parallelx.bigmodels import estimate
from parallelx.check import command as check_command
from parallelx.checkpoints import sharded
from parallelx.checkpoints.trainstate import STATE_FILE, latest_checkpoint
from parallelx.cli import exit_on_error
from parallelx.errors import ParallelxError
from parallelx.launching import envreport
from parallelx.launching.runner import launch
from parallelx.registry import available_backends, backend_class, describe, detect_backend, markdown_table
from parallelx.storage import Location
from parallelx.strategy import BackendSpec
from parallelx.tensor_parallel.plan import find_plan, split_shares


@exit_on_error
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallelx")
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="print torch/CUDA versions and which backends are usable here")
    env.add_argument(
        "--network",
        action="store_true",
        help="instead: check this machine's network for a job of several machines (run it on each): whether "
        "MASTER_ADDR:MASTER_PORT is reachable, the interface collectives will use, the clock and the host name",
    )
    env.add_argument("--master-addr", default=None, help="with --network (default: $MASTER_ADDR)")
    env.add_argument("--master-port", type=int, default=None, help="with --network (default: $MASTER_PORT, else 29500)")
    env.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="S",
        help="with --network on the master's machine: hold the port S seconds and answer the other machines' checks",
    )
    table = sub.add_parser("launchers", help="print the Markdown table of backends and their launch lines")
    table.add_argument("--module", default="recipes.dogcat", help="the module the launch lines run")
    run = sub.add_parser(
        "launch",
        help="start a script on this machine with a backend's own launcher",
        description="Builds the launcher's command line (loopback interface, a free port) and "
        "runs it; --backend NAME is added to the script's arguments.",
    )
    run.add_argument("backend", help="single, dp, ddp, horovod, deepspeed")
    run.add_argument("-n", "--nproc", type=int, default=2, help="processes to start (default 2)")
    run.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    conv = sub.add_parser(
        "convert-checkpoint",
        help="write a sharded training-state checkpoint as one portable file",
        description="SRC: a checkpoint directory (step-*) or a run directory (its newest "
        "checkpoint); DST: the file, state.pt's layout with the whole model and "
        "optimizer, for torch.load(DST, weights_only=True).  One process, no launcher.",
    )
    conv.add_argument("src")
    conv.add_argument("dst")
    conv.add_argument(
        "--to",
        choices=("torch", "safetensors"),
        default="torch",
        help="torch: one portable file (default); safetensors: DST is a folder of the model's weights as "
        "Hugging Face loads them (model.safetensors, or shards and their index), read one tensor at a time",
    )
    conv.add_argument(
        "--max-shard-size", default=None, metavar="SIZE", help="with --to safetensors: e.g. 5GB (default: one file)"
    )
    checking = sub.add_parser(
        "check",
        help="prove that a training script gives the same numbers on every backend",
        description="Runs SCRIPT (after --) for a few optimizer steps on every backend, under its own launcher, "
        "and in one process playing the ranks; compares them against the script's own measured noise floor and "
        "names the likely cause of any difference.  Exit status: 0 the same numbers, 1 something differs, "
        "2 the check could not run.",
    )
    check_command.add_arguments(checking)
    guess = sub.add_parser(
        "estimate",
        help="memory per rank on each backend and ZeRO stage, the model built on the meta device",
        description="MODEL: module:function or path/to/file.py:function (a factory called without arguments "
        "that returns an nn.Module), or a Hugging Face config (config.json, a folder, a hub name).  Nothing is "
        "allocated: the model is built on the meta device.  Activations are not counted (docs/big-models.md).",
    )
    guess.add_argument("model")
    guess.add_argument(
        "--world-sizes", type=_world_sizes, default=[2, 4, 8], metavar="N,N", help="processes (default 2,4,8)"
    )
    guess.add_argument("--optimizer", choices=list(estimate.OPTIMIZERS), default="adamw", help="default adamw")
    guess.add_argument("--precision", choices=estimate.PRECISIONS, default="32", help="default 32")
    guess.add_argument(
        "--build",
        choices=("eager", "meta"),
        default="eager",
        help="eager: every rank builds the whole model (default); meta: built under parallelx.init_module()",
    )
    guess.add_argument("--backends", default=None, metavar="A,B", help="default: every backend registered")
    guess.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="N",
        help="each block's split layers over N ranks (the default plan or the model's tp_plan): the backends "
        "that take it, at each world size N divides (default 1)",
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    # Everything after "--" is the script's (argparse's REMAINDER would also swallow -n and --dry-run).
    target = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.command == "launchers":
        print(markdown_table(args.module), end="")
        return 0
    if args.command == "env":
        if args.network:
            return envreport.network_main(args.master_addr, args.master_port, args.wait)
        return envreport.main(_descriptions(), detect_backend())
    if args.command == "convert-checkpoint":
        return _convert(storage.location(args.src), storage.location(args.dst), args.to, args.max_shard_size)
    if args.command == "check":
        return check_command.main(args, target)
    if args.command == "estimate":
        return _estimate(args)
    return _launch(args.backend, args.nproc, target, dry_run=args.dry_run)


def _descriptions() -> dict[str, BackendSpec | Exception]:
    """Every registered backend's description, or why it does not load (a broken third-party entry point)."""
    out: dict[str, BackendSpec | Exception] = {}
    for name in available_backends():
        if name == "auto":
            continue
        try:
            out[name] = describe(name)
        except Exception as exc:
            out[name] = exc
    return out


def _world_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected processes such as 2,4,8, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected processes >= 1 such as 2,4,8, got {text!r}")
    return sizes


def _estimate(args: argparse.Namespace) -> int:
    tp = args.tensor_parallel
    if tp < 1:
        raise ParallelxError(f"--tensor-parallel must be at least 1, got {tp}")
    training = estimate.Training(
        optimizer=args.optimizer, precision=args.precision, build=args.build, tensor_parallel=tp
    )
    model, what = estimate.build_on_meta(args.model)
    shares = {}
    if tp > 1:  # this rank's share of each split layer (nothing is changed: the plan is only read)
        plan = find_plan(model, tp)
        shares = split_shares(model, plan, tp)
        what += f"; {plan.describe(tp)}"
    counts = estimate.count_model(model, shares)
    names = [n for n in available_backends() if n != "auto"]
    if args.backends:
        asked = [n.strip() for n in args.backends.split(",") if n.strip()]
        unknown = [n for n in asked if n not in names]
        if unknown:
            raise ParallelxError(f"unknown backend {', '.join(unknown)}; valid backends are: {', '.join(names)}")
        names = asked
    rows = []
    for name in names:
        cls = backend_class(name)
        sizes = args.world_sizes if cls.spec.launcher.multi_process else [1]
        if tp > 1:  # the data-parallel part of each world size; backends without tensor parallelism left out
            if not cls.spec.tensor_parallel:
                continue
            found = [
                dataclasses.replace(row, backend=f"{row.backend} tp{tp}", world_size=n)
                for n in sizes
                if n % tp == 0
                for row in cls.estimate_memory(counts, n // tp, training)
            ]
        else:
            found = [row for n in sizes for row in cls.estimate_memory(counts, n, training)]
        order = list(dict.fromkeys(row.backend for row in found))  # a backend's variants, each at every size
        rows += sorted(found, key=lambda row: (order.index(row.backend), row.world_size))
    print(estimate.describe(counts, what))
    print(f"per rank, {args.optimizer}, precision {args.precision}, {args.build} build; activations not counted\n")
    print(estimate.table(rows), end="")
    return 0


def _convert(src: Location, dst: Location, to: str = "torch", max_shard_size: str | None = None) -> int:
    """SRC and DST each a local path or a URL: a checkpoint in a store is a whole one (DCP shards are
    written to local disks only), and the files written go to DST whole, as every save does there."""
    found = src if storage.is_file(storage.join(src, STATE_FILE)) else latest_checkpoint(src)
    if found is None:
        raise ParallelxError(
            f"{storage.show(src)} holds no training-state checkpoint (no {STATE_FILE}, no checkpoints/latest)"
        )
    state_file = storage.join(found, STATE_FILE)
    if to == "safetensors":
        files = sharded.convert_to_safetensors(state_file, dst, max_shard_size=max_shard_size)
        print(f"wrote {len(files)} safetensors file(s) under {storage.show(dst)} from {storage.show(found)}")
        return 0
    print(f"wrote {storage.show(sharded.convert(state_file, dst))} from {storage.show(found)}")
    return 0


def _launch(name: str, nproc: int, target: list[str], *, dry_run: bool) -> int:

    if not target:
        raise ParallelxError("nothing to launch: end with `-- -m package.module [args]` or `-- script.py [args]`")
    if nproc < 1:
        raise ParallelxError(f"-n must be >= 1, got {nproc}")
    described = describe(name)
    spec = described.launcher
    if spec.program_path() is None:
        raise ParallelxError(f"the {spec.name} launcher is not installed; {described.install_hint}")
    target = [*target, "--backend", described.name]
    if dry_run:
        print(" ".join(spec.command(target, nproc if spec.multi_process else 1)))
        return 0
    try:
        # On this terminal, no time limit: Ctrl-C reaches the launcher as from the shell.
        return launch(spec, target, nproc, timeout=None, interactive=True).returncode
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
