"""Helpers for command-line entry points (recipes, benchmarks, tools)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TypeVar

from .errors import ParallelxError

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
