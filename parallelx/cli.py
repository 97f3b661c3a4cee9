"""Helpers for command-line entry points (recipes, benchmarks, tools)."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from .errors import ParallelxError

if TYPE_CHECKING:
    from .backend import Backend

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

    return wrapper  # type: ignore[return-value]


def add_backend_arguments(parser: argparse.ArgumentParser, default: str = "auto") -> None:
    """``--backend``, ``--timeout`` and every registered backend's own options."""
    from .registry import available_backends, backend_class

    names = available_backends()
    parser.add_argument("--backend", default=default, choices=names,
                        help=f"distributed backend (default: {default}, which follows the launcher)")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="give up on a collective after this long (default: $PARALLELX_TIMEOUT or 1800)")
    for name in names:
        if name == "auto":
            continue
        try:
            backend_class(name).add_arguments(parser)
        except ImportError:  # a broken third-party backend must not break the CLI
            continue


def backend_from_args(args: argparse.Namespace) -> Backend:
    """Create (not init) the backend that ``args.backend`` names, with its options."""
    from .registry import backend_class, detect_backend, get_backend

    name = detect_backend() if args.backend == "auto" else args.backend
    return get_backend(name, **backend_class(name).options_from_args(args))
