"""The command line shared by the recipes, the checks that run before any
data is read or any process group is joined, and what the options mean:
the learning-rate schedule (:func:`make_scheduler`) and ``--resume``
(:func:`resume`, over :class:`parallelx.Checkpointer`).

Every option a user can get wrong fails here with one line on stderr,
``error: ...``, and exit status 2: the numbers through argparse ``type=``
validators (:class:`RecipeParser` prints argparse's errors as that one line
too), the file-system paths through :func:`validate`, which raises
:class:`~parallelx.ParallelxError` (the recipes' ``main`` is wrapped with
:func:`parallelx.exit_on_error`).  A run that gets past these checks and the
data loaders does not stop on its inputs halfway through training.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch

import parallelx
from parallelx import storage
from parallelx.errors import ParallelxError

#: Seeds are used as ``seed + epoch`` and ``seed + 1000 * rank`` too; NumPy's
#: range keeps every one of them valid for ``torch.manual_seed``.
SEED_MAX = 2**32 - 1
LR_SCHEDULES = ("constant", "cosine", "step")


class HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default once: appended to its help, except where
    the help states it itself (``%(default)s``, or in words for a default of
    None, with nothing appended) and for flags (whose default is False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        if (
            "%(default)" in help
            or action.default is None
            or action.default is False
            or action.default is argparse.SUPPRESS
            or action.required
            or not action.option_strings
        ):
            return help
        return f"{help} (default: %(default)s)"


class RecipeParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, ``error: ...``, exit
    status 2, like every other input error of the recipes (argparse's own
    output repeats the whole usage, many lines for these scripts)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


# --------------------------------------------------------------- argparse types
def _number(text: str, kind: Callable[[str], float | int]) -> float | int:
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def int_at_least(low: int) -> Callable[[str], int]:
    """argparse type: an integer >= ``low``."""

    def parse(text: str) -> int:
        value = int(_number(text, int))
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    value = float(_number(text, float))
    if not (value >= 0 and math.isfinite(value)):  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def seed(text: str) -> int:
    """argparse type: a random seed in ``[0, SEED_MAX]``."""
    value = int(_number(text, int))
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, {SEED_MAX}], got {value}")
    return value


def learning_rate(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = float(_number(text, float))
    if not (value > 0 and math.isfinite(value)):  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def momentum(text: str) -> float:
    """argparse type: SGD momentum in [0, 1).  At 1 or above the velocity
    never decays and the weights diverge."""
    value = float(_number(text, float))
    if not 0 <= value < 1:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text}; 0.9 is usual")
    return value


def proportion(text: str) -> float:
    """argparse type: a number in [0, 1) (a dropout probability)."""
    value = float(_number(text, float))
    if not 0 <= value < 1:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text}")
    return value


def fraction(text: str) -> float:
    """argparse type: a number strictly between 0 and 1."""
    value = float(_number(text, float))
    if not 0 < value < 1:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a number strictly between 0 and 1, got {text}")
    return value


# ---------------------------------------------------------------------- parser
def base_parser(
    prog: str,
    description: str,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    sgd: bool = True,
    sample: str = "images",
    lr_help: str = "learning rate",
    data_help: str = "where the dataset is (see --help of each recipe)",
    num_workers_help: str = "data-loader workers per process (default: this process's share of the cores, minus one)",
    num_workers: int | None = None,
) -> RecipeParser:
    """The options every recipe has.  ``sgd``: also ``--momentum``,
    ``--lr-schedule`` and ``--warmup-epochs``; without it ``--data-dir`` is
    optional (the recipe says in ``data_help`` what it does without one)."""
    p = RecipeParser(prog=prog, description=description, formatter_class=HelpFormatter)
    parallelx.add_arguments(p)
    p.add_argument("--data-dir", type=Path, required=sgd, default=None, help=data_help)
    p.add_argument("--epochs", type=positive_int, default=epochs, help="passes over the training set")
    p.add_argument("--batch-size", type=positive_int, default=batch_size, help=f"{sample} per process per step")
    p.add_argument("--lr", type=learning_rate, default=lr, help=lr_help)
    if sgd:
        p.add_argument("--momentum", type=momentum, default=0.9, help="SGD momentum, in [0, 1)")
    p.add_argument("--seed", type=seed, default=0, help=f"random seed, 0 to {SEED_MAX}")
    p.add_argument("--num-workers", type=non_negative_int, default=num_workers, help=num_workers_help)
    p.add_argument(
        "--max-steps",
        type=positive_int,
        default=None,
        help="cap on micro-batches per epoch and process, for quick runs (default: the whole epoch)",
    )
    if sgd:
        p.add_argument(
            "--lr-schedule",
            choices=LR_SCHEDULES,
            default="constant",
            help="learning rate over the optimizer steps: constant; cosine (to 0 at the end); step (x0.1 at "
            "50%% and 75%% of the steps)",
        )
        p.add_argument(
            "--warmup-epochs",
            type=non_negative_float,
            default=0.0,
            help="ramp the learning rate up linearly over this many epochs first (fractions allowed)",
        )
    p.add_argument(
        "--out-dir",
        type=storage.location,
        default=None,
        help="where outputs go: a local folder or an object store's URL (s3://bucket/run, gs://..., az://...; "
        "pip install 'parallelx[s3]') (default: runs/<recipe>-<backend>)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=positive_int,
        default=None,
        metavar="STEPS",
        help="write a training-state checkpoint into OUT_DIR/checkpoints every STEPS optimizer steps "
        "(and at every epoch's end); turns on SIGTERM handling: save at the next step, then stop "
        "(default: no checkpoints, unless --resume is given)",
    )
    p.add_argument(
        "--resume",
        default=None,
        metavar="{auto,PATH}",
        help="continue from a checkpoint: auto = the latest in --out-dir, or a fresh start when there is "
        "none (use it in launch lines, so that a restarted job resumes by itself); PATH = that "
        "checkpoint directory (or its URL). Also turns on epoch-end checkpoints and SIGTERM handling "
        "(default: start afresh)",
    )
    p.add_argument(
        "--checkpoint-async",
        action="store_true",
        help="write the checkpoints in the background: training stops only while each process copies its "
        "state into memory; a checkpoint is complete a few steps later (default: training waits for the files)",
    )
    p.add_argument(
        "--keep-checkpoints",
        type=positive_int,
        default=3,
        metavar="K",
        help="how many of the newest checkpoints to keep",
    )
    return p


def make_scheduler(
    optimizer: Any, kind: str, *, steps: int, warmup_steps: int, floor: float = 0.0
) -> torch.optim.lr_scheduler.LambdaLR:
    """``--lr-schedule``: a schedule over ``steps`` optimizer steps (it is
    stepped once per optimizer step, by ``backend.step``): a linear warm-up
    from ``1/(warmup_steps+1)`` of the LR, then constant, cosine down to
    ``floor`` times the LR, or x0.1 at 50 % and x0.01 at 75 % of the steps."""
    if kind not in LR_SCHEDULES:
        raise ParallelxError(f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}, got {kind!r}")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        done = (step - warmup_steps) / max(1, steps - warmup_steps)
        if kind == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, done)))
        if kind == "step":
            return 0.01 if done >= 0.75 else 0.1 if done >= 0.5 else 1.0
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def resume(ckpt: parallelx.Checkpointer, resume: str | None, recipe: str) -> None:
    """``--resume`` (``auto``, a path, or None): load the checkpoint it names into
    ``ckpt`` (a collective), refusing one written by another recipe."""
    ckpt.resume(resume)
    if ckpt.path is not None and ckpt["recipe"] != recipe:
        raise ParallelxError(
            f"checkpoint {ckpt.path} is of the {ckpt['recipe']!r} recipe, this is {recipe!r}; "
            "resume a run with the recipe that wrote it"
        )


# ------------------------------------------------------------------ validation
def validate(args: argparse.Namespace) -> None:
    """The checks of the shared options that argparse cannot make: the
    file system.  ``args.out_dir`` must be set (the recipes fill in the
    default first).  Raises :class:`ParallelxError`."""
    check_out_dir(args.out_dir)
    check_data_dir(args.data_dir)
    check_num_workers(getattr(args, "num_workers", None))
    check_resume(getattr(args, "resume", None))
    epochs = getattr(args, "epochs", None)
    if epochs is not None and getattr(args, "warmup_epochs", 0) >= epochs:
        raise ParallelxError(
            f"--warmup-epochs {args.warmup_epochs} must be less than --epochs {epochs}: the "
            "learning rate would never reach --lr"
        )


def check_resume(resume: str | None) -> None:
    """``--resume PATH`` must name something that exists (whether it holds a
    usable checkpoint is checked when it is read)."""
    if resume is None or resume == "auto":
        return
    if not resume:
        raise ParallelxError("--resume needs 'auto' or the path of a checkpoint directory")
    if storage.is_url(resume):
        return  # read (and a missing one named) when it is loaded, on every rank alike
    if not Path(resume).exists():
        raise ParallelxError(
            f"--resume {resume}: no such checkpoint (a directory such as "
            "OUT_DIR/checkpoints/step-00000120); use --resume auto to take the latest when there "
            "is one"
        )


def check_num_workers(workers: int | None) -> None:
    """A bound on loader workers: each is a process with its own copy of the
    dataset object, so thousands of them exhaust memory or process ids in
    the middle of the first epoch."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = max(8, 4 * cores)
    if workers is not None and workers > limit:
        raise ParallelxError(
            f"--num-workers {workers} would start {workers} loader processes per training process "
            f"on {cores} CPU core(s); use at most {limit} (the default, each process's share of "
            "the cores less one, suits most runs)"
        )


def check_data_dir(path: Path | None) -> None:
    """A data directory that exists must be a directory.  (A missing one is
    reported by the data loaders, which know how to make one.)"""
    if path is not None and path.exists() and not path.is_dir():
        raise ParallelxError(f"--data-dir {path} is a file; expected the directory that holds the dataset")


def check_out_dir(path: storage.Location, option: str = "--out-dir") -> None:
    """``path`` is an existing writable directory, or one that can be created:
    its nearest existing ancestor is a writable directory.  Checked by
    writing a probe file, since ``os.access`` says yes to root even on a
    read-only file system.  A URL is probed when the run makes it (its store
    answers, its bucket exists: :func:`recipes.history.make_out_dir`)."""
    if not isinstance(path, Path):
        return
    if path.is_symlink() and not path.exists():
        raise ParallelxError(
            f"{option} {path} is a broken symbolic link (to {os.readlink(path)}); remove it or choose another directory"
        )
    if path.exists() and not path.is_dir():
        raise ParallelxError(
            f"{option} {path} is a file; expected a directory (it is created if missing): choose another path"
        )
    nearest = path
    while not nearest.exists():
        if nearest.is_symlink():
            raise ParallelxError(f"{option} {path} cannot be created: {nearest} is a broken symbolic link")
        if nearest.parent == nearest:
            break
        nearest = nearest.parent
    if not nearest.is_dir():
        raise ParallelxError(
            f"{option} {path} cannot be created: {nearest} is a file, not a directory; "
            "choose a path that is not under a file"
        )
    if not os.access(nearest, os.W_OK | os.X_OK) or not _can_write_in(nearest):
        where = "" if nearest == path else f" (it would be created in {nearest})"
        raise ParallelxError(f"{option} {path} is not writable{where}; choose a directory you can write to")


def _can_write_in(directory: Path) -> bool:
    try:
        fd, probe = tempfile.mkstemp(prefix=".parallelx-write-probe-", dir=directory)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True
