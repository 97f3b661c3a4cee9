"""The training engine shared by the recipes: epochs of train and val phases
on any parallelx backend.

What it gets right on every backend:
- global loss and accuracy count every sample exactly once (the sampler's
  padding duplicates are masked out, sums are all-reduced), so they equal what
  one process computes with the same weights;
- the shuffle changes every epoch (the sampler advances itself);
- progress bars and console output on the main rank only;
- ``optimizer.zero_grad()`` after every step;
- data-loader workers sized per process, not ``cpu_count()`` in every process;
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

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

import parallelx
from parallelx import Backend, MetricSums, Preemption, ShardedSampler, warn
from parallelx.errors import ParallelxError
from parallelx.utils import threads_per_process

from .data import EpochKeys, SeededSamples

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
        return cls(epochs=args.epochs, batch_size=args.batch_size, seed=args.seed, num_workers=args.num_workers,
                   max_steps=args.max_steps, out_dir=args.out_dir,
                   lr_schedule=args.lr_schedule, warmup_epochs=args.warmup_epochs,
                   checkpoint_every=args.checkpoint_every, resume=args.resume,
                   keep_checkpoints=args.keep_checkpoints)

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


def default_num_workers(local_world_size: int) -> int:
    """Loader workers per process: this process's share of the cores, less
    the one that trains, at most 8.  0 (load in the training process) when a
    process has a single core: more workers would only fight over it."""
    return min(8, threads_per_process(local_world_size) - 1)


def _loader(backend: Backend, dataset: Dataset, cfg: FitConfig, *, train: bool, keyed: bool = False) -> DataLoader:
    """The loader of one split.  ``keyed``: batches are ``(x, y, index)`` and
    each sample's augmentation depends on (seed, epoch, index) only
    (:class:`~recipes.data.SeededSamples`), which an exact resume needs."""
    workers = default_num_workers(backend.local_world_size) if cfg.num_workers is None else cfg.num_workers
    share = threads_per_process(backend.local_world_size)
    if workers > share:
        warn(f"--num-workers {workers} is more than this process's share of the CPU cores ({share}); "
             "the extra workers only compete for them")
    sampler = backend.make_sampler(dataset, shuffle=train, seed=cfg.seed)
    return DataLoader(
        SeededSamples(dataset, cfg.seed) if keyed else dataset,
        batch_size=cfg.batch_size,
        sampler=EpochKeys(sampler) if keyed else sampler,
        num_workers=workers,
        pin_memory=backend.device.type == "cuda",
        persistent_workers=workers > 0,
        worker_init_fn=_own_process_group,
        # Random augmentations must differ between ranks; the shuffle must not.
        generator=torch.Generator().manual_seed(cfg.seed + 1000 * backend.rank),
    )


@dataclass
class EpochProgress:
    """How far the training pass of one epoch has got: what a checkpoint
    stores to continue it exactly.  ``loss_sum``, ``correct`` and ``count``
    are this rank's own metric sums; the other fields are equal on every rank."""

    batches: int = 0  # micro-batches of this epoch done, over all passes
    optimizer_steps: int = 0
    skipped: int = 0
    norm_sum: float = 0.0  # sum of the steps' gradient norms (a float32 value)
    loss_sum: float = 0.0
    correct: int = 0
    count: int = 0
    seconds: float = 0.0
    pass_start: int = field(default=0, compare=False)  # micro-batches done when this loader pass began


#: Called after every optimizer step with a snapshot function and whether the
#: pass ends with this step; True stops the pass (preemption).
StepHook = Callable[[Callable[[], EpochProgress], bool], bool]


def _sharded(loader: DataLoader) -> ShardedSampler:
    sampler = loader.sampler
    return sampler.sampler if isinstance(sampler, EpochKeys) else sampler  # type: ignore[return-value]


def _own_process_group(worker_id: int) -> None:
    """Loader workers leave their training process's process group: torchrun
    sends SIGTERM to that whole group, and a loader worker that dies of it
    takes its training process down before that process can save its
    checkpoint (see ``parallelx.Preemption``).  Workers still end with the
    loader (which may SIGTERM them itself), or within seconds of their
    training process."""
    os.setpgid(0, 0)


def run_epoch(backend: Backend, model: nn.Module, loader: DataLoader, criterion: Callable[..., torch.Tensor], *,
              optimizer: Any = None, scheduler: Any = None, desc: str = "",
              max_steps: int | None = None, progress: EpochProgress | None = None,
              on_step: StepHook | None = None, epoch: int = 0) -> dict[str, Any]:
    """One pass over ``loader``: trains when ``optimizer`` is given, else
    evaluates.  Returns the global ``loss``, ``acc``, ``count`` and
    ``seconds``; training adds ``lr`` (after the pass), ``grad_norm`` (mean
    over the optimizer steps, before clipping), ``steps`` and ``skipped``.
    ``criterion`` must return per-sample losses (``reduction="none"``).

    ``progress`` continues an epoch a checkpoint interrupted (its counts and
    this rank's metric sums; the loader's sampler already starts where it
    stopped); ``max_steps`` counts the micro-batches done before.
    ``on_step`` runs after every optimizer step; when it returns True the
    pass stops there and the result is ``{"stopped": True}``."""
    train = optimizer is not None
    model.train(train)
    sampler = _sharded(loader)
    sums = MetricSums(sampler)  # leaves the sampler's padding duplicates out by itself
    p = progress or EpochProgress()
    done = p.batches
    steps = len(loader) if max_steps is None else min(len(loader), max(1, max_steps - done))
    if train and p != EpochProgress():
        sums.loss_sum = torch.tensor(p.loss_sum, dtype=torch.float64)
        sums.correct = torch.tensor(p.correct, dtype=torch.int64)
        sums.count = torch.tensor(p.count, dtype=torch.int64)
    start = time.perf_counter()
    shows_bar = backend.is_main()
    # Training goes through backend.batches: accumulation windows, the same
    # number of batches on every rank; evaluation needs neither.
    batches = backend.batches(loader, limit=steps) if train else itertools.islice(loader, steps)
    bar = tqdm(batches, total=steps, desc=desc, disable=not shows_bar, leave=False, dynamic_ncols=True,
               mininterval=1.0)
    norm_sum = torch.tensor(p.norm_sum, dtype=torch.float32, device=backend.device)
    optimizer_steps, skipped, stopped = p.optimizer_steps, p.skipped, False

    def snapshot() -> EpochProgress:  # host syncs: only when a checkpoint is written
        return EpochProgress(batches=done + step + 1, optimizer_steps=optimizer_steps, skipped=skipped,
                             norm_sum=float(norm_sum), loss_sum=float(sums.loss_sum), correct=int(sums.correct),
                             count=int(sums.count), seconds=p.seconds + time.perf_counter() - start,
                             pass_start=done)

    step = -1
    try:
        with torch.set_grad_enabled(train):
            for step, batch in enumerate(bar):
                x = batch[0].to(backend.device, non_blocking=True)
                y = batch[1].to(backend.device, non_blocking=True)
                with backend.autocast():
                    out = model(x)
                    per_sample = criterion(out, y)
                result = None
                if train:
                    backend.backward(per_sample.mean())
                    result = backend.step(optimizer, scheduler)
                    if result is not None:
                        optimizer_steps += 1
                        skipped += result.skipped
                        norm_sum += result.grad_norm.to(norm_sum.device)
                sums.update(per_sample, out.argmax(1) == y)
                # .item() waits for the GPU: only on the rank that shows the bar, every 10th step.
                if shows_bar and step % 10 == 0:
                    bar.set_postfix(loss=f"{per_sample.mean().item():.4f}")
                if result is not None and on_step is not None and on_step(snapshot, step + 1 == steps):
                    stopped = True
                    break
    except ParallelxError as exc:
        raise ParallelxError(_worker_message(str(exc))) from None
    finally:
        bar.close()
        if hasattr(batches, "close"):
            batches.close()  # a pass left early: the backend's window bookkeeping ends too
    if stopped:
        return {"stopped": True}
    result = sums.compute(backend)
    result["seconds"] = p.seconds + time.perf_counter() - start
    if train:
        result.update(lr=optimizer.param_groups[0]["lr"], steps=optimizer_steps, skipped=skipped,
                      grad_norm=float(norm_sum) / max(1, optimizer_steps))
    return result


def _worker_message(message: str) -> str:
    """The message of an error raised in a data-loader worker, without the
    worker's traceback that the DataLoader adds to it when it re-raises."""
    marker = "ParallelxError: "
    if "Original Traceback" in message and marker in message:
        return message.rsplit(marker, 1)[1].strip()
    return message


@dataclass
class _RunState:
    """The loop's own state besides the weights: what ``fit`` saves and resumes."""

    epoch: int = 1  # the epoch in progress (1-based); epochs + 1 when all are done
    progress: EpochProgress = field(default_factory=EpochProgress)
    global_step: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    best_acc: float = -1.0
    best_epoch: int = 0


def fit(backend: Backend, model: nn.Module, optimizer: Any, train_set: Dataset, val_set: Dataset,
        cfg: FitConfig, *, run_info: dict[str, Any] | None = None) -> dict[str, Any]:
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
    scheduler = make_scheduler(optimizer, cfg.lr_schedule, steps=steps_per_epoch * cfg.epochs,
                               warmup_steps=round(cfg.warmup_epochs * steps_per_epoch))
    out = Path(cfg.out_dir)
    _make_out_dir(backend, out)
    recipe = str((run_info or {}).get("recipe", ""))
    since = time.perf_counter()
    backend.print(f"backend={backend.name} world_size={backend.world_size} device={backend.device} "
                  f"train={len(train_set)} val={len(val_set)} batch/process={cfg.batch_size} "
                  f"workers/process={train_loader.num_workers} {_loop_summary(backend, cfg)}")
    run = _RunState()
    if cfg.resume is not None:
        run = _resume(backend, cfg, out, recipe, model, optimizer, scheduler, sampler)

    def save(progress: EpochProgress, sampler_state: dict[str, Any]) -> None:
        """A training-state checkpoint (collective)."""
        sums = backend.all_gather_object([progress.loss_sum, progress.correct, progress.count])
        extra = {"recipe": recipe, "history": run.history, "best_acc": run.best_acc, "sums": sums,
                 "norm_sum": progress.norm_sum, "seconds": progress.seconds}
        counters = {"epoch": run.epoch, "batches": progress.batches, "optimizer_steps": progress.optimizer_steps,
                    "skipped": progress.skipped, "global_step": run.global_step, "best_epoch": run.best_epoch}
        path = parallelx.save_training_state(backend, out, step=run.global_step, model=model, optimizer=optimizer,
                                             scheduler=scheduler, sampler=sampler_state, counters=counters,
                                             keep=cfg.keep_checkpoints, extra=extra)
        backend.print(f"checkpoint {path}: epoch {run.epoch}, micro-batch {progress.batches}, "
                      f"step {run.global_step}")
        backend.elastic_commit()  # an elastic run that loses a rank goes back to this checkpoint

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
            save(snap, sampler.state_dict(consumed=consumed))
        return stop

    with preempt if cfg.checkpointing else contextlib.nullcontext():
        while run.epoch <= cfg.epochs:
            epoch = run.epoch
            backend.print(f"Epoch {epoch}/{cfg.epochs}\n" + "-" * 10)
            tr = run_epoch(backend, model, train_loader, criterion, optimizer=optimizer, scheduler=scheduler,
                           desc=f"train {epoch}", max_steps=cfg.max_steps, progress=run.progress,
                           on_step=on_step, epoch=epoch)
            if tr.get("stopped"):
                return _preempted(backend, preempt, run)
            backend.print(f"train Loss: {tr['loss']:.4f} Acc: {tr['acc']:.4f} lr: {tr['lr']:.6g} "
                          f"grad norm: {tr['grad_norm']:.4f}"
                          + (f" skipped steps: {tr['skipped']}" if tr["skipped"] else ""))
            if not math.isfinite(tr["loss"]):  # all-reduced: every rank stops together
                raise ParallelxError(f"the training loss is {tr['loss']} in epoch {epoch}: the weights diverged; "
                                     "lower --lr and run again")
            va = run_epoch(backend, model, val_loader, criterion, desc=f"val {epoch}")
            backend.print(f"val Loss: {va['loss']:.4f} Acc: {va['acc']:.4f}")
            run.history.append({
                "epoch": epoch, "train_loss": tr["loss"], "train_acc": tr["acc"], "val_loss": va["loss"],
                "val_acc": va["acc"], "epoch_time_s": tr["seconds"] + va["seconds"],
                "train_images_per_s": tr["count"] / tr["seconds"], "val_images_per_s": va["count"] / va["seconds"],
                "lr": tr["lr"], "grad_norm": tr["grad_norm"], "optimizer_steps": tr["steps"],
                "skipped_steps": tr["skipped"],
            })
            # val acc is all-reduced, so every rank takes this branch together:
            # the save below is collective and must be called by all of them.
            if va["acc"] > run.best_acc:
                run.best_acc, run.best_epoch = va["acc"], epoch
                backend.save(model, out / "best.pth")
            if backend.is_main():
                _write_history(out, run.history)
            run.epoch, run.progress = epoch + 1, EpochProgress()
            if cfg.checkpointing:
                # The sampler's pass is over (or cut by max_steps): the next epoch starts at its beginning.
                save(run.progress, sampler.state_dict(consumed=sampler.num_samples))
                if preempt.should_stop(backend):
                    return _preempted(backend, preempt, run)
    history, best_acc, best_epoch = run.history, run.best_acc, run.best_epoch
    # The weights after the last step, as a plain state_dict (collective, like best.pth).
    backend.save(model, out / "last.pth")
    total = time.perf_counter() - since
    metrics = {
        "best_val_acc": best_acc, "best_epoch": best_epoch,
        "final_val_loss": history[-1]["val_loss"], "final_val_acc": history[-1]["val_acc"],
        "total_time_s": total, "backend": backend.name, "world_size": backend.world_size,
        "train_images_per_s": sum(h["train_images_per_s"] for h in history) / len(history),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "loop": asdict(backend.options),
        **(run_info or {}),
    }
    if backend.is_main():
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        _write_history(out, history)
        _plot(out / "training_results.png", history)
    backend.print(f"Training complete in {int(total // 60)}m {int(total % 60)}s")
    backend.print(f"Best val Acc: {best_acc:.4f}")
    backend.print(f"outputs in {out.resolve()}")
    backend.barrier()
    return metrics


def fit_elastic(backend: Backend, build: Callable[[bool], tuple[nn.Module, Any]], train_set: Dataset,
                val_set: Dataset, cfg: FitConfig, *, run_info: dict[str, Any] | None = None) -> dict[str, Any]:
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
        return fit(backend, model, optimizer, train_set, val_set, cfg.resumed() if again else cfg,
                   run_info=run_info)

    return backend.run_elastic(train)


def _preempted(backend: Backend, preempt: Preemption, run: _RunState) -> dict[str, Any]:
    why = preempt.signal.name if preempt.signal is not None else "a stop request on another rank"
    backend.print(f"preempted ({why}): checkpoint written at epoch {run.epoch}, step {run.global_step}; "
                  "run the same command with --resume auto to continue")
    backend.barrier()
    return {"preempted": True, "epoch": run.epoch, "global_step": run.global_step}


def _resume(backend: Backend, cfg: FitConfig, out: Path, recipe: str, model: nn.Module, optimizer: Any,
            scheduler: Any, sampler: ShardedSampler) -> _RunState:
    """Load the checkpoint ``cfg.resume`` names (every rank); a fresh state
    when it is "auto" and there is none yet."""
    found, error = None, None
    if backend.is_main():  # one rank decides, so that every rank loads the same checkpoint
        try:
            path = _checkpoint_path(cfg.resume, out)
            found = None if path is None else str(path)
        except ParallelxError as exc:
            error = str(exc)
    found, error = backend.broadcast((found, error), src=0)
    if error is not None:
        raise ParallelxError(error)
    if found is None:
        backend.print(f"--resume auto: no checkpoint in {out / parallelx.trainstate.SUBDIR} yet; starting from the "
                      "beginning")
        return _RunState()
    info = parallelx.load_training_state(backend, found, model=model, optimizer=optimizer, scheduler=scheduler,
                                         sampler=sampler)
    extra, c, meta = info["extra"], info["counters"], info["meta"]
    if not isinstance(extra, dict) or "sums" not in extra:
        raise ParallelxError(f"checkpoint {found} was not written by a recipe (no loop state in it); "
                             "resume recipes from their own checkpoints")
    if extra.get("recipe") != recipe:
        raise ParallelxError(f"checkpoint {found} is of the {extra.get('recipe')!r} recipe, this is {recipe!r}; "
                             "resume a run with the recipe that wrote it")
    sums = extra["sums"]
    if len(sums) == backend.world_size:
        loss_sum, correct, count = sums[backend.rank]
    else:  # another world size: rank 0 carries the totals (the sums then round in another order)
        loss_sum = sum(float(s[0]) for s in sums) if backend.is_main() else 0.0
        correct = sum(int(s[1]) for s in sums) if backend.is_main() else 0
        count = sum(int(s[2]) for s in sums) if backend.is_main() else 0
    progress = EpochProgress(batches=c["batches"], optimizer_steps=c["optimizer_steps"], skipped=c["skipped"],
                             norm_sum=float(extra["norm_sum"]), loss_sum=float(loss_sum), correct=int(correct),
                             count=int(count), seconds=float(extra["seconds"]))
    run = _RunState(epoch=c["epoch"], progress=progress, global_step=c["global_step"],
                    history=[dict(h) for h in extra["history"]], best_acc=float(extra["best_acc"]),
                    best_epoch=c["best_epoch"])
    where = (f"epoch {run.epoch}, after micro-batch {progress.batches} of it" if progress.batches
             else f"the start of epoch {run.epoch}")
    if run.epoch > cfg.epochs:
        where = f"the end of training (all {cfg.epochs} epochs done)"
    backend.print(f"resuming from {found}: {where}, optimizer step {run.global_step} (written by "
                  f"{meta['backend']} with {meta['world_size']} process(es))")
    return run


def _checkpoint_path(resume: str | None, out: Path) -> Path | None:
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
        raise ParallelxError(f"--resume {path}: no checkpoint there (expected a checkpoint directory holding "
                             f"{parallelx.trainstate.STATE_FILE}, or an --out-dir with "
                             f"{parallelx.trainstate.SUBDIR}/); use --resume auto to start afresh when none exists")
    return latest


def _loop_summary(backend: Backend, cfg: FitConfig) -> str:
    o = backend.options
    return (f"accumulate={o.accumulate} clip_grad_norm={o.clip_grad_norm} precision={o.precision} "
            f"grad_compression={o.grad_compression} lr_schedule={cfg.lr_schedule} warmup_epochs={cfg.warmup_epochs}")


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


def _write_history(out: Path, history: list[dict[str, float]]) -> None:
    import pandas as pd

    tmp = out / "history.csv.tmp"
    pd.DataFrame(history).to_csv(tmp, index=False)
    os.replace(tmp, out / "history.csv")


def _plot(path: Path, history: list[dict[str, float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    fig, (ax_acc, ax_loss, ax_lr) = plt.subplots(1, 3, figsize=(15, 4))
    ax_lr.plot(epochs, [h["lr"] for h in history], "o-", color="tab:green", label="lr (end of epoch)")
    ax_lr.set_xlabel("epoch")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_title("learning rate and gradient norm")
    ax_norm = ax_lr.twinx()
    ax_norm.plot(epochs, [h["grad_norm"] for h in history], "s--", color="tab:red", label="grad norm (mean)")
    ax_norm.set_ylabel("gradient norm before clipping")
    ax_lr.legend(loc="upper left")
    ax_norm.legend(loc="upper right")
    ax_lr.xaxis.get_major_locator().set_params(integer=True)
    for ax, key in ((ax_acc, "acc"), (ax_loss, "loss")):
        ax.plot(epochs, [h[f"train_{key}"] for h in history], "o-", label="train")
        ax.plot(epochs, [h[f"val_{key}"] for h in history], "o-", label="val")
        ax.set_xlabel("epoch")
        ax.set_ylabel(key)
        ax.set_title(f"{key}: train vs val")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def evaluate_state_dict(model: nn.Module, dataset: Dataset, batch_size: int = 256) -> dict[str, float]:
    """Single-process evaluation of ``model`` on ``dataset`` (no backend):
    the reference the distributed val figures must equal."""
    model.eval()
    sums = MetricSums()
    criterion = nn.CrossEntropyLoss(reduction="none")
    with torch.no_grad():
        for x, y in DataLoader(dataset, batch_size=batch_size):
            out = model(x)
            sums.update(criterion(out, y), out.argmax(1) == y)
    return sums.compute()
