"""What the monitor is asked to do: :class:`MonitorOptions`, from arguments or the command line."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parallelx import storage
from parallelx.errors import ParallelxError
from parallelx.observability.profiling import parse_steps
from parallelx.observability.trackers.catalog import parse_loggers

#: Optimizer steps between two logging intervals (throughput figures, and the
#: device values logged since the last interval read in one transfer).
DEFAULT_LOG_EVERY = 50


@dataclass(frozen=True)
class MonitorOptions:
    """Trackers, throughput and profiles of one run (``get_backend(..., loggers=..., monitor=...)``)."""

    #: Tracker names (``--logger``): built-ins ``csv``, ``tensorboard``, ``mlflow``, ``wandb``, or registered ones.
    loggers: tuple[str, ...] = ()
    #: The run directory (``--logger-dir``): tracker files and profiles, a local path or a store's URL
    #: (written to a local staging folder and copied there as the files change). None: ``runs/<date>-<time>``.
    log_dir: Path | str | None = None
    #: Optimizer steps per logging interval (``--logger-every``).
    log_every: int = DEFAULT_LOG_EVERY
    #: Measure throughput and MFU; None: when a logger is given.
    throughput: bool | None = None
    #: Peak TFLOP/s of one device (``--peak-tflops``); None: from the GPU table.
    peak_tflops: float | None = None
    #: Tokens in one sample (``--tokens-per-sample``), for tokens/s.
    tokens_per_sample: int | None = None
    #: Optimizer steps to profile, 1-based and inclusive (``--profile-steps A:B``).
    profile_steps: tuple[int, int] | None = None
    #: Also record CUDA memory history over the profiled steps (``--memory-snapshot``, GPUs).
    memory_snapshot: bool = False
    #: The run's name in MLflow and W&B; None: the run directory's name.
    run_name: str | None = None
    #: Count the FLOPs of the first micro-batch (FlopCounterMode); False: no FLOP/s, no MFU.
    count_flops: bool = True
    #: FLOPs of one sample's forward and backward, when you know them (e.g. 6 x parameters x tokens
    #: for a transformer): used instead of counting.
    flops_per_sample: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "loggers", parse_loggers(self.loggers))
        if self.log_dir is not None:
            object.__setattr__(self, "log_dir", storage.location(self.log_dir))
        if isinstance(self.log_every, bool) or not isinstance(self.log_every, int) or self.log_every < 1:
            raise ParallelxError(f"log_every must be an integer >= 1 (optimizer steps), got {self.log_every!r}")
        if self.peak_tflops is not None and not (self.peak_tflops > 0 and math.isfinite(self.peak_tflops)):
            raise ParallelxError(f"peak_tflops must be a finite number > 0, got {self.peak_tflops!r}")
        if self.tokens_per_sample is not None and (
            isinstance(self.tokens_per_sample, bool) or int(self.tokens_per_sample) < 1
        ):
            raise ParallelxError(f"tokens_per_sample must be an integer >= 1, got {self.tokens_per_sample!r}")
        object.__setattr__(self, "profile_steps", parse_steps(self.profile_steps))
        if self.flops_per_sample is not None and not (
            self.flops_per_sample > 0 and math.isfinite(self.flops_per_sample)
        ):
            raise ParallelxError(f"flops_per_sample must be a finite number > 0, got {self.flops_per_sample!r}")

    @property
    def measures_throughput(self) -> bool:
        return bool(self.loggers) if self.throughput is None else self.throughput

    @property
    def active(self) -> bool:
        """Anything to do at the loop's marks."""
        return bool(self.loggers) or self.measures_throughput or self.profile_steps is not None

    @classmethod
    def make(
        cls,
        monitor: MonitorOptions | Mapping[str, Any] | None = None,
        *,
        loggers: str | Sequence[str] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
    ) -> MonitorOptions:
        """The options from a backend's constructor: ``monitor`` (options or
        a dict of their fields), with ``loggers`` and ``log_dir`` given beside it."""
        if isinstance(monitor, MonitorOptions):
            base = monitor
        else:
            fields = {f.name for f in dataclasses.fields(cls)}
            given = dict(monitor or {})
            if unknown := sorted(set(given) - fields):
                raise ParallelxError(
                    f"unknown monitor option(s) {', '.join(unknown)}; valid: {', '.join(sorted(fields))}"
                )
            base = cls(**given)
        changes: dict[str, Any] = {}
        if loggers is not None:
            changes["loggers"] = loggers
        if log_dir is not None:
            changes["log_dir"] = log_dir
        return dataclasses.replace(base, **changes) if changes else base

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MonitorOptions:
        """The options of the parsed ``--logger``, ``--logger-dir``, ... (``parallelx.cli.add_arguments``)."""
        fields = {
            "loggers": getattr(args, "loggers", None),
            "log_dir": getattr(args, "logger_dir", None),
            "log_every": getattr(args, "logger_every", None),
            "peak_tflops": getattr(args, "peak_tflops", None),
            "tokens_per_sample": getattr(args, "tokens_per_sample", None),
            "profile_steps": getattr(args, "profile_steps", None),
            "memory_snapshot": getattr(args, "memory_snapshot", None),
        }
        return cls(**{k: v for k, v in fields.items() if v is not None})
