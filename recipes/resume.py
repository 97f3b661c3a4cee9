"""Training-state checkpoints of a recipe run, and resuming from them exactly.

A checkpoint holds, besides the weights, optimizer and schedule (through
:func:`parallelx.save_training_state`): the sampler's position in samples
consumed by training, the epoch's partial metric sums of every rank, the
history and the best accuracy, so that the resumed run continues as if it had
not stopped.  A run stopped by SIGTERM ends with :func:`preempted`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

import parallelx
from parallelx import Backend, Preemption, ShardedSampler
from parallelx.errors import ParallelxError

from .epoch import EpochProgress


@dataclass
class RunState:
    """The loop's own state besides the weights: what ``fit`` saves and resumes."""

    epoch: int = 1  # the epoch in progress (1-based); epochs + 1 when all are done
    progress: EpochProgress = field(default_factory=EpochProgress)
    global_step: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    best_acc: float = -1.0
    best_epoch: int = 0


@dataclass(frozen=True)
class RunCheckpoints:
    """The checkpoints of one run: what goes into them and where (``out/checkpoints``)."""

    backend: Backend
    out: Path
    recipe: str
    model: nn.Module
    optimizer: Any
    scheduler: Any
    keep: int

    def save(self, run: RunState, progress: EpochProgress, sampler_state: dict[str, Any]) -> None:
        """A training-state checkpoint (collective)."""
        backend = self.backend
        sums = backend.all_gather_object([progress.loss_sum, progress.correct, progress.count])
        extra = {
            "recipe": self.recipe,
            "history": run.history,
            "best_acc": run.best_acc,
            "sums": sums,
            "norm_sum": progress.norm_sum,
            "seconds": progress.seconds,
        }
        counters = {
            "epoch": run.epoch,
            "batches": progress.batches,
            "optimizer_steps": progress.optimizer_steps,
            "skipped": progress.skipped,
            "global_step": run.global_step,
            "best_epoch": run.best_epoch,
        }
        path = parallelx.save_training_state(
            backend,
            self.out,
            step=run.global_step,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            sampler=sampler_state,
            counters=counters,
            keep=self.keep,
            extra=extra,
        )
        backend.print(f"checkpoint {path}: epoch {run.epoch}, micro-batch {progress.batches}, step {run.global_step}")
        backend.elastic_commit()  # an elastic run that loses a rank goes back to this checkpoint

    def resume(self, resume: str, epochs: int, sampler: ShardedSampler) -> RunState:
        """Load the checkpoint ``resume`` (``--resume``) names (every rank); a
        fresh state when it is "auto" and there is none yet."""
        backend, out, recipe = self.backend, self.out, self.recipe
        found, error = None, None
        if backend.is_main():  # one rank decides, so that every rank loads the same checkpoint
            try:
                path = checkpoint_path(resume, out)
                found = None if path is None else str(path)
            except ParallelxError as exc:
                error = str(exc)
        found, error = backend.broadcast((found, error), src=0)
        if error is not None:
            raise ParallelxError(error)
        if found is None:
            backend.print(
                f"--resume auto: no checkpoint in {out / parallelx.trainstate.SUBDIR} yet; starting from the beginning"
            )
            return RunState()
        info = parallelx.load_training_state(
            backend, found, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, sampler=sampler
        )
        extra, c, meta = info["extra"], info["counters"], info["meta"]
        if not isinstance(extra, dict) or "sums" not in extra:
            raise ParallelxError(
                f"checkpoint {found} was not written by a recipe (no loop state in it); "
                "resume recipes from their own checkpoints"
            )
        if extra.get("recipe") != recipe:
            raise ParallelxError(
                f"checkpoint {found} is of the {extra.get('recipe')!r} recipe, this is "
                f"{recipe!r}; resume a run with the recipe that wrote it"
            )
        sums = extra["sums"]
        if len(sums) == backend.world_size:
            loss_sum, correct, count = sums[backend.rank]
        else:  # another world size: rank 0 carries the totals (the sums then round in another order)
            loss_sum = sum(float(s[0]) for s in sums) if backend.is_main() else 0.0
            correct = sum(int(s[1]) for s in sums) if backend.is_main() else 0
            count = sum(int(s[2]) for s in sums) if backend.is_main() else 0
        progress = EpochProgress(
            batches=c["batches"],
            optimizer_steps=c["optimizer_steps"],
            skipped=c["skipped"],
            norm_sum=float(extra["norm_sum"]),
            loss_sum=float(loss_sum),
            correct=int(correct),
            count=int(count),
            seconds=float(extra["seconds"]),
        )
        run = RunState(
            epoch=c["epoch"],
            progress=progress,
            global_step=c["global_step"],
            history=[dict(h) for h in extra["history"]],
            best_acc=float(extra["best_acc"]),
            best_epoch=c["best_epoch"],
        )
        where = (
            f"epoch {run.epoch}, after micro-batch {progress.batches} of it"
            if progress.batches
            else f"the start of epoch {run.epoch}"
        )
        if run.epoch > epochs:
            where = f"the end of training (all {epochs} epochs done)"
        backend.print(
            f"resuming from {found}: {where}, optimizer step {run.global_step} (written by "
            f"{meta['backend']} with {meta['world_size']} process(es))"
        )
        return run


def checkpoint_path(resume: str | None, out: Path) -> Path | None:
    """The checkpoint ``--resume`` names: "auto" is the latest in ``out`` (None
    when there is none); a path is a checkpoint directory, or a run directory
    whose latest checkpoint is taken."""
    if resume == "auto":
        return parallelx.latest_checkpoint(out)
    path = Path(str(resume))
    if (path / parallelx.trainstate.STATE_FILE).is_file():
        return path
    latest = parallelx.latest_checkpoint(path) if path.is_dir() else None
    if latest is None:
        raise ParallelxError(
            f"--resume {path}: no checkpoint there (expected a checkpoint directory holding "
            f"{parallelx.trainstate.STATE_FILE}, or an --out-dir with "
            f"{parallelx.trainstate.SUBDIR}/); use --resume auto to start afresh when none exists"
        )
    return latest


def preempted(backend: Backend, preempt: Preemption, run: RunState) -> dict[str, Any]:
    """End a run that SIGTERM (here or on another rank) stopped after its checkpoint: what ``fit`` returns then."""
    why = preempt.signal.name if preempt.signal is not None else "a stop request on another rank"
    backend.print(
        f"preempted ({why}): checkpoint written at epoch {run.epoch}, step {run.global_step}; "
        "run the same command with --resume auto to continue"
    )
    backend.barrier()
    return {"preempted": True, "epoch": run.epoch, "global_step": run.global_step}
