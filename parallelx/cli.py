"""The command line of a training script: one call adds the options, one
builds the backend::

    parser = argparse.ArgumentParser()
    parallelx.add_arguments(parser)        # --backend, --device, --timeout, every backend's own
    args = parser.parse_args()
    backend = parallelx.from_args(args)    # not yet initialised: `with backend:` or backend.init()

Every backend's options are added whichever backend runs, so a script accepts
the flags a launcher appends (the deepspeed launcher's ``--local_rank``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

from parallelx.backend import Backend
from parallelx.errors import ParallelxError
from parallelx.observability import DEFAULT_LOG_EVERY, MonitorOptions, available_trackers, parse_loggers
from parallelx.parts.loop import COMPRESSIONS, PRECISIONS
from parallelx.registry import available_backends, backend_class, detect_backend, get_backend
from parallelx.settings import DEVICES
from parallelx.transforms.compiling import MODES

F = TypeVar("F", bound=Callable[..., int | None])


def exit_on_error(fn: F) -> F:
    """Run ``fn``; turn a :class:`ParallelxError` into its one-line message on
    stderr and exit status 2, instead of a wall of traceback.  Other
    exceptions are real bugs and keep their traceback."""

    @functools.wraps(fn)
    def wrapper(*args: object, **kwargs: object) -> int | None:
        try:
            return fn(*args, **kwargs)
        except ParallelxError as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None

    return cast(F, wrapper)


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


#: The end of the help of an option whose default is None and whose help says in
#: words what None means.  It renders as nothing; it is there because argparse's
#: ArgumentDefaultsHelpFormatter, which a script's parser may use, appends
#: "(default: None)" to every help without "%(default)" in it.
NONE_IN_WORDS = "%(default).0s"


def add_arguments(parser: argparse.ArgumentParser, default: str = "auto") -> argparse.ArgumentParser:
    """Add ``--backend``, ``--device``, ``--timeout``, the training-loop options
    (``--accumulate``, ``--clip-grad-norm``, ``--precision``,
    ``--grad-compression``), the trackers' and profiles' (``--logger``,
    ``--profile-steps``, ...: :func:`add_tracking_arguments`) and every
    registered backend's own options to ``parser``; returns the parser."""
    names = available_backends()
    group = parser.add_argument_group("parallelx")
    group.add_argument(
        "--backend",
        default=default,
        choices=names,
        help="distributed backend; auto follows the launcher (default: %(default)s)",
    )
    group.add_argument(
        "--device",
        default="auto",
        choices=DEVICES,
        help="auto: this process's GPU if there is one, else the CPU; cpu forces the CPU (default: %(default)s)",
    )
    group.add_argument(
        "--timeout",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help="give up on a collective after this long (default: $PARALLELX_TIMEOUT or 1800)" + NONE_IN_WORDS,
    )
    loop = parser.add_argument_group("training loop (the same update on every backend)")
    loop.add_argument(
        "--accumulate",
        type=positive_int,
        default=None,
        metavar="N",
        help="micro-batches per optimizer step: gradient accumulation (default: 1)" + NONE_IN_WORDS,
    )
    loop.add_argument(
        "--clip-grad-norm",
        type=positive_float,
        default=None,
        metavar="X",
        help="clip the averaged gradients to this global 2-norm (default: no clipping)" + NONE_IN_WORDS,
    )
    loop.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=None,
        help="32, bf16-mixed (autocast; CPU and GPU) or 16-mixed (autocast + loss scaling; GPUs) "
        "(default: 32)" + NONE_IN_WORDS,
    )
    loop.add_argument(
        "--grad-compression",
        choices=COMPRESSIONS,
        default=None,
        help="gradient data type on the wire (default: none)" + NONE_IN_WORDS,
    )
    model = parser.add_argument_group("model (applied by backend.wrap_model, as each backend needs)")
    model.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model: ddp's wrapper (its buckets still overlap), fsdp's units before "
        "sharding, DeepSpeed's engine, the model elsewhere",
    )
    model.add_argument(
        "--compile-mode",
        choices=MODES,
        default=None,
        help="torch.compile's mode (implies --compile; default: default)" + NONE_IN_WORDS,
    )
    model.add_argument(
        "--activation-checkpointing",
        nargs="?",
        const="auto",
        default=None,
        metavar="CLASSES",
        help="recompute these modules' activations in the backward: auto (the blocks fsdp shards) or class "
        "names, e.g. Block (default: off; the flag alone: auto)" + NONE_IN_WORDS,
    )
    model.add_argument(
        "--cpu-offload",
        action="store_true",
        help="keep sharded state in CPU memory between uses, on GPUs: fsdp's parameters and gradients "
        "(CPUOffloadPolicy), DeepSpeed ZeRO's optimizer state (offload_optimizer)",
    )
    add_tracking_arguments(parser)
    for name in names:
        if name == "auto":
            continue
        try:
            backend_class(name).add_arguments(parser)
        except ImportError:  # a broken third-party backend must not break the CLI
            continue
    return parser


def loggers_type(text: str) -> tuple[str, ...]:
    """argparse type: comma-separated tracker names."""
    try:
        return parse_loggers(text)
    except ParallelxError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_tracking_arguments(parser: argparse.ArgumentParser) -> None:
    """``--logger``, ``--logger-dir``, ``--logger-every``, ``--peak-tflops``,
    ``--tokens-per-sample``, ``--profile-steps``, ``--memory-snapshot`` (docs/trackers.md)."""
    group = parser.add_argument_group("trackers, throughput and profiles")
    group.add_argument(
        "--logger",
        dest="loggers",
        type=loggers_type,
        default=None,
        metavar="NAMES",
        help=f"comma-separated trackers: {', '.join(available_trackers())} (default: none)" + NONE_IN_WORDS,
    )
    group.add_argument(
        "--logger-dir",
        type=str,
        default=None,
        metavar="DIR",
        help="the run directory for the trackers' files and the profiles (default: runs/<date>-<time>)" + NONE_IN_WORDS,
    )
    group.add_argument(
        "--logger-every",
        type=positive_int,
        default=None,
        metavar="STEPS",
        help=f"optimizer steps per logging interval (default: {DEFAULT_LOG_EVERY})" + NONE_IN_WORDS,
    )
    group.add_argument(
        "--peak-tflops",
        type=positive_float,
        default=None,
        metavar="X",
        help="peak TFLOP/s of one device, for MFU (default: from the table of GPUs)" + NONE_IN_WORDS,
    )
    group.add_argument(
        "--tokens-per-sample",
        type=positive_int,
        default=None,
        metavar="N",
        help="tokens in one sample, for tokens/s (default: not reported)" + NONE_IN_WORDS,
    )
    group.add_argument(
        "--profile-steps",
        default=None,
        metavar="A:B",
        help="record torch.profiler for optimizer steps A to B (from 1), a trace per rank (default: none)"
        + NONE_IN_WORDS,
    )
    group.add_argument(
        "--memory-snapshot",
        action="store_true",
        help="with --profile-steps on GPUs: also record the CUDA memory history of those steps",
    )


def from_args(args: argparse.Namespace, **overrides: Any) -> Backend:
    """Create (not init) the backend that ``args.backend`` names (``auto``
    included), with the options the parsed arguments give it; the parsed
    arguments are the run's hyperparameters for its trackers.  ``overrides``
    are constructor options that win over the arguments' (a script's own
    choices); ``monitor={...}`` changes only the fields it names, e.g.
    ``from_args(args, monitor={"throughput": True})`` for a progress bar's
    throughput without a ``--logger``."""
    name = getattr(args, "backend", "auto") or "auto"
    if name == "auto":
        name = detect_backend()
    options = backend_class(name).options_from_args(args)
    monitor = MonitorOptions.from_args(args)
    if (changes := overrides.pop("monitor", None)) is not None:
        monitor = dataclasses.replace(monitor, **dict(changes)) if isinstance(changes, Mapping) else changes
    backend = get_backend(name, monitor=monitor, **{**options, **overrides})
    backend.monitor.log_hyperparams(args)
    return backend


# Aliases, documented as such.
add_backend_arguments = add_arguments
backend_from_args = from_args
