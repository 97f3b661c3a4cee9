"""What a recipe run is asked to do: :class:`FitConfig`, checked once when it
is made, and the learning-rate schedule it names."""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from parallelx.errors import ParallelxError


@dataclass(frozen=True, kw_only=True)
class FitConfig:
    epochs: int
    batch_size: int
    out_dir: Path
    seed: int = 0
    num_workers: int | None = None
    max_steps: int | None = None  # per epoch: cap on micro-batches, for quick runs
    lr_schedule: str = "constant"
    warmup_epochs: float = 0.0
    #: Optimizer steps between training-state checkpoints (None: only at epoch ends, when checkpointing).
    checkpoint_every: int | None = None
    #: "auto" (the latest checkpoint in out_dir, else a fresh start) or a checkpoint's path.
    resume: str | None = None
    keep_checkpoints: int = 3

    @property
    def checkpointing(self) -> bool:
        """Checkpoints (and SIGTERM handling) are on when either option asks for them."""
        return self.checkpoint_every is not None or self.resume is not None

    def resumed(self) -> FitConfig:
        """This configuration, resuming from the latest checkpoint if there is one."""
        return dataclasses.replace(self, resume="auto")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FitConfig:
        """The configuration the options of ``recipes.common.base_parser`` give."""
        return cls(
            epochs=args.epochs,
            batch_size=args.batch_size,
            seed=args.seed,
            num_workers=args.num_workers,
            max_steps=args.max_steps,
            out_dir=args.out_dir,
            lr_schedule=args.lr_schedule,
            warmup_epochs=args.warmup_epochs,
            checkpoint_every=args.checkpoint_every,
            resume=args.resume,
            keep_checkpoints=args.keep_checkpoints,
        )

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise ParallelxError(f"--epochs must be >= 1, got {self.epochs}")
        if self.batch_size < 1:
            raise ParallelxError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.num_workers is not None and self.num_workers < 0:
            raise ParallelxError(f"--num-workers must be >= 0, got {self.num_workers}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ParallelxError(f"--max-steps must be >= 1, got {self.max_steps}")
        if self.lr_schedule not in SCHEDULES:
            raise ParallelxError(f"--lr-schedule must be one of {', '.join(SCHEDULES)}, got {self.lr_schedule!r}")
        if not 0 <= self.warmup_epochs < self.epochs:
            raise ParallelxError(f"--warmup-epochs must be in [0, --epochs), got {self.warmup_epochs}")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ParallelxError(f"--checkpoint-every must be >= 1, got {self.checkpoint_every}")
        if self.keep_checkpoints < 1:
            raise ParallelxError(f"--keep-checkpoints must be >= 1, got {self.keep_checkpoints}")


SCHEDULES = ("constant", "cosine", "step")


def make_scheduler(optimizer: Any, kind: str, *, steps: int, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A per-optimizer-step schedule over ``steps`` steps: linear warm-up from
    ``1/(warmup_steps+1)`` of the LR, then constant, cosine to 0, or x0.1 at
    50 % and x0.01 at 75 % of the steps.  It is stepped once per optimizer
    step (``backend.step``), on every backend."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        done = (step - warmup_steps) / max(1, steps - warmup_steps)
        if kind == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(1.0, done)))
        if kind == "step":
            return 0.01 if done >= 0.75 else 0.1 if done >= 0.5 else 1.0
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
