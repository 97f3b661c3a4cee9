"""The seam every tracker sits behind: :class:`Tracker`.

A tracker writes what the main rank logs (numbers, already read from the
device and reduced where asked) to one destination: a CSV file, TensorBoard
event files, an MLflow store, a W&B run.  It never sees a tensor, a rank or a
collective; :class:`parallelx.observability.Monitor` does that part once for all of
them.  A third-party tracker subclasses :class:`Tracker` and registers itself
in the ``parallelx.trackers`` entry-point group (see
:mod:`parallelx.observability.trackers.catalog`).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from parallelx.utils import missing_package

#: What a tracker gets for one logging call: name -> value, at a step and a wall time (seconds since the epoch).
Scalars = Mapping[str, float]


class Tracker(abc.ABC):
    """One destination for metrics and hyperparameters.

    Created and used on the main rank only, from one thread at a time (the
    monitor's writer thread): ``open`` once, then ``log_hyperparams`` and
    ``log_metrics`` any number of times, ``flush`` at each logging interval,
    and ``close`` once at the end.
    """

    #: Registry name, e.g. ``"tensorboard"``.
    name: ClassVar[str] = ""
    #: The importable package the tracker needs, if any, and how to install it.
    requires_module: ClassVar[str | None] = None
    install_hint: ClassVar[str] = "pip install 'parallelx[trackers]'"

    def __init__(self, run_dir: Path, run_name: str) -> None:
        #: The run's directory (created before ``open``); the tracker writes its files under it.
        self.run_dir = run_dir
        #: A short name for the run (the directory's name unless the user chose one).
        self.run_name = run_name

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this tracker cannot run here (its package is missing), or None; imports nothing heavy."""
        return missing_package(cls.requires_module, cls.install_hint)

    @abc.abstractmethod
    def open(self) -> None:
        """Connect or create files.  Errors here stop the run (a tracker the user asked for does not work)."""

    @abc.abstractmethod
    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """Record the run's configuration once: flat names to numbers, strings or booleans."""

    @abc.abstractmethod
    def log_metrics(self, metrics: Scalars, step: int, wall_time: float) -> None:
        """Record ``metrics`` at ``step``; ``wall_time`` is when they were logged (``time.time()``)."""

    def flush(self) -> None:
        """Make what was logged so far visible to readers."""

    def close(self, *, failed: bool = False) -> None:
        """Flush and release; ``failed``: the run ended with an error (trackers that keep a status record it)."""


def flat_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``params`` flattened to ``{"a/b": value}``, values kept when they are
    numbers, strings, booleans or None (as ``"None"``), else their ``str()``:
    what every tracker can store."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat_params(value, prefix=f"{name}/"))
        elif isinstance(value, (bool, str)) or (isinstance(value, (int, float)) and math.isfinite(value)):
            out[name] = value
        else:
            out[name] = str(value)
    return out
