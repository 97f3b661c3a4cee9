"""The training engine shared by the recipes: epochs of train and val phases
on any parallelx backend (:func:`fit`, and :func:`fit_elastic` around it).

The concerns live in modules of their own, and every name is importable from
here as well:

- :mod:`recipes.config`: :class:`FitConfig` and the learning-rate schedules;
- :mod:`recipes.epoch`: one pass (:func:`run_epoch`) with exact global
  metrics, the loaders, :func:`evaluate_state_dict`;
- :mod:`recipes.resume`: training-state checkpoints and resuming exactly;
- :mod:`recipes.history`: ``history.csv``, ``metrics.json``, the plot.

What :func:`fit` gets right on every backend:
- ``optimizer.zero_grad()`` after every step, console output on the main rank only;
- the best model (by val accuracy) is saved by *every* rank calling
  ``backend.save`` (a collective under ZeRO-3), written once by the main rank;
- with checkpoints on (``checkpoint_every`` or ``resume``), a training-state
  checkpoint every N optimizer steps (never inside an accumulation window)
  and at every epoch's end, and a resumed run that continues exactly:
  weights, optimizer, schedule, the sampler's position in samples consumed
  by training, the epoch's partial metrics, the history and the best
  accuracy; SIGTERM makes every rank save at the next step boundary and stop.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn
from torch.utils.data import Dataset

import parallelx
from parallelx import Backend, Preemption
from parallelx.errors import ParallelxError

from .config import SCHEDULES, FitConfig, make_scheduler
from .epoch import EpochProgress, StepHook, _loader, _sharded, default_num_workers, evaluate_state_dict, run_epoch
from .history import epoch_row, final_metrics, write_history, write_outputs
from .resume import RunCheckpoints, RunState, checkpoint_path, preempted

__all__ = [
    "SCHEDULES",
    "EpochProgress",
    "FitConfig",
    "RunCheckpoints",
    "RunState",
    "StepHook",
    "checkpoint_path",
    "default_num_workers",
    "evaluate_state_dict",
    "fit",
    "fit_elastic",
    "make_scheduler",
    "run_epoch",
]


def fit(
    backend: Backend,
    model: nn.Module,
    optimizer: Any,
    train_set: Dataset,
    val_set: Dataset,
    cfg: FitConfig,
    *,
    run_info: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train for ``cfg.epochs``; write ``best.pth``, ``last.pth``, ``history.csv``,
    ``metrics.json`` and ``training_results.png`` into ``cfg.out_dir``, and,
    with ``cfg.checkpointing``, training-state checkpoints under
    ``out_dir/checkpoints/``.  Returns the final metrics (on every rank);
    ``{"preempted": True, ...}`` when SIGTERM stopped it after a checkpoint."""
    criterion = nn.CrossEntropyLoss(reduction="none")
    train_loader = _loader(backend, train_set, cfg, train=True, keyed=True)
    val_loader = _loader(backend, val_set, cfg, train=False)
    sampler = _sharded(train_loader)
    # Measured before a checkpoint moves the sampler into the middle of an epoch.
    micro = len(train_loader) if cfg.max_steps is None else min(len(train_loader), cfg.max_steps)
    steps_per_epoch = math.ceil(micro / backend.options.accumulate)
    scheduler = make_scheduler(
        optimizer,
        cfg.lr_schedule,
        steps=steps_per_epoch * cfg.epochs,
        warmup_steps=round(cfg.warmup_epochs * steps_per_epoch),
    )
    out = Path(cfg.out_dir)
    _make_out_dir(backend, out)
    recipe = str((run_info or {}).get("recipe", ""))
    since = time.perf_counter()
    backend.print(
        f"backend={backend.name} world_size={backend.world_size} device={backend.device} "
        f"train={len(train_set)} val={len(val_set)} batch/process={cfg.batch_size} "
        f"workers/process={train_loader.num_workers} {_loop_summary(backend, cfg)}"
    )
    checkpoints = RunCheckpoints(backend, out, recipe, model, optimizer, scheduler, keep=cfg.keep_checkpoints)
    run = RunState() if cfg.resume is None else checkpoints.resume(cfg.resume, cfg.epochs, sampler)
    preempt = Preemption()

    def on_step(snapshot: Callable[[], EpochProgress], last: bool) -> bool:
        run.global_step += 1
        # The last step of a pass is followed by validation and the epoch's own checkpoint.
        if not cfg.checkpointing or last:
            return False
        stop = preempt.should_stop(backend)  # collective: every rank, every step
        if stop or (cfg.checkpoint_every is not None and run.global_step % cfg.checkpoint_every == 0):
            snap = snapshot()
            consumed = min((snap.batches - snap.pass_start) * cfg.batch_size, sampler.num_samples)
            checkpoints.save(run, snap, sampler.state_dict(consumed=consumed))
        return stop

    with preempt if cfg.checkpointing else contextlib.nullcontext():
        while run.epoch <= cfg.epochs:
            epoch = run.epoch
            backend.print(f"Epoch {epoch}/{cfg.epochs}\n" + "-" * 10)
            # run_epoch is looked up in this module at every call, so that a
            # wrapper assigned to recipes.engine.run_epoch takes effect here.
            tr = run_epoch(
                backend,
                model,
                train_loader,
                criterion,
                optimizer=optimizer,
                scheduler=scheduler,
                desc=f"train {epoch}",
                max_steps=cfg.max_steps,
                progress=run.progress,
                on_step=on_step,
                epoch=epoch,
            )
            if tr.get("stopped"):
                return preempted(backend, preempt, run)
            backend.print(
                f"train Loss: {tr['loss']:.4f} Acc: {tr['acc']:.4f} lr: {tr['lr']:.6g} "
                f"grad norm: {tr['grad_norm']:.4f}" + (f" skipped steps: {tr['skipped']}" if tr["skipped"] else "")
            )
            if not math.isfinite(tr["loss"]):  # all-reduced: every rank stops together
                raise ParallelxError(
                    f"the training loss is {tr['loss']} in epoch {epoch}: the weights diverged; "
                    "lower --lr and run again"
                )
            va = run_epoch(backend, model, val_loader, criterion, desc=f"val {epoch}")
            backend.print(f"val Loss: {va['loss']:.4f} Acc: {va['acc']:.4f}")
            run.history.append(epoch_row(epoch, tr, va))
            # val acc is all-reduced, so every rank takes this branch together:
            # the save below is collective and must be called by all of them.
            if va["acc"] > run.best_acc:
                run.best_acc, run.best_epoch = va["acc"], epoch
                backend.save(model, out / "best.pth")
            if backend.is_main():
                write_history(out, run.history)
            run.epoch, run.progress = epoch + 1, EpochProgress()
            if cfg.checkpointing:
                # The sampler's pass is over (or cut by max_steps): the next epoch starts at its beginning.
                checkpoints.save(run, run.progress, sampler.state_dict(consumed=sampler.num_samples))
                if preempt.should_stop(backend):
                    return preempted(backend, preempt, run)
    # The weights after the last step, as a plain state_dict (collective, like best.pth).
    backend.save(model, out / "last.pth")
    total = time.perf_counter() - since
    metrics = final_metrics(
        backend, cfg, run.history, best_acc=run.best_acc, best_epoch=run.best_epoch, total_s=total, run_info=run_info
    )
    if backend.is_main():
        write_outputs(out, metrics, run.history)
    backend.print(f"Training complete in {int(total // 60)}m {int(total % 60)}s")
    backend.print(f"Best val Acc: {run.best_acc:.4f}")
    backend.print(f"outputs in {out.resolve()}")
    backend.barrier()
    return metrics


def fit_elastic(
    backend: Backend,
    build: Callable[[bool], tuple[nn.Module, Any]],
    train_set: Dataset,
    val_set: Dataset,
    cfg: FitConfig,
    *,
    run_info: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """:func:`fit` through ``backend.run_elastic``: ``build(again)`` makes the
    model and its optimizer (unwrapped; ``again`` is True on a call after the
    first), which ``backend.setup`` wraps.  Returns what :func:`fit` returned."""
    attempt = itertools.count()

    def train() -> dict[str, Any]:
        # Called again in an elastic run that lost a rank (horovodrun --min-np):
        # then from the seed, and from the latest checkpoint if there is one.
        again = next(attempt) > 0
        if again:
            parallelx.seed_everything(cfg.seed)
        model, optimizer = backend.setup(*build(again))
        return fit(backend, model, optimizer, train_set, val_set, cfg.resumed() if again else cfg, run_info=run_info)

    return backend.run_elastic(train)


def _loop_summary(backend: Backend, cfg: FitConfig) -> str:
    o = backend.options
    return (
        f"accumulate={o.accumulate} clip_grad_norm={o.clip_grad_norm} precision={o.precision} "
        f"grad_compression={o.grad_compression} lr_schedule={cfg.lr_schedule} warmup_epochs={cfg.warmup_epochs}"
    )


def _make_out_dir(backend: Backend, out: Path) -> None:
    """The main rank creates ``out``; a failure stops every rank (the others
    would otherwise train on and wait for it in the first collective)."""
    error = None
    if backend.is_main():
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            error = f"cannot create the output directory {out} ({exc.strerror or exc}); choose another --out-dir"
    error = backend.broadcast(error, src=0)
    if error is not None:
        raise ParallelxError(error)
