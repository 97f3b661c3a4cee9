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
  ``backend.save`` (a collective under ZeRO-3), written once by the main rank.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from parallelx import Backend, MetricSums, warn
from parallelx.errors import ParallelxError
from parallelx.utils import threads_per_process


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


def _loader(backend: Backend, dataset: Dataset, cfg: FitConfig, *, train: bool) -> DataLoader:
    workers = default_num_workers(backend.local_world_size) if cfg.num_workers is None else cfg.num_workers
    share = threads_per_process(backend.local_world_size)
    if workers > share:
        warn(f"--num-workers {workers} is more than this process's share of the CPU cores ({share}); "
             "the extra workers only compete for them")
    return DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=backend.make_sampler(dataset, shuffle=train, seed=cfg.seed),
        num_workers=workers,
        pin_memory=backend.device.type == "cuda",
        persistent_workers=workers > 0,
        # Random augmentations must differ between ranks; the shuffle must not.
        generator=torch.Generator().manual_seed(cfg.seed + 1000 * backend.rank),
    )


def run_epoch(backend: Backend, model: nn.Module, loader: DataLoader, criterion: Callable[..., torch.Tensor], *,
              optimizer: Any = None, scheduler: Any = None, desc: str = "",
              max_steps: int | None = None) -> dict[str, float]:
    """One pass over ``loader``: trains when ``optimizer`` is given, else
    evaluates.  Returns the global ``loss``, ``acc``, ``count`` and
    ``seconds``; training adds ``lr`` (after the pass), ``grad_norm`` (mean
    over the optimizer steps, before clipping), ``steps`` and ``skipped``.
    ``criterion`` must return per-sample losses (``reduction="none"``)."""
    train = optimizer is not None
    model.train(train)
    sums = MetricSums(loader.sampler)  # leaves the sampler's padding duplicates out by itself
    steps = len(loader) if max_steps is None else min(len(loader), max_steps)
    start = time.perf_counter()
    shows_bar = backend.is_main()
    # Training goes through backend.batches: accumulation windows, the same
    # number of batches on every rank; evaluation needs neither.
    batches = backend.batches(loader, limit=steps) if train else itertools.islice(loader, steps)
    bar = tqdm(batches, total=steps, desc=desc, disable=not shows_bar, leave=False, dynamic_ncols=True,
               mininterval=1.0)
    norm_sum = torch.zeros((), device=backend.device)
    optimizer_steps = skipped = 0
    try:
        with torch.set_grad_enabled(train):
            for step, (x, y) in enumerate(bar):
                x = x.to(backend.device, non_blocking=True)
                y = y.to(backend.device, non_blocking=True)
                with backend.autocast():
                    out = model(x)
                    per_sample = criterion(out, y)
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
    except ParallelxError as exc:
        raise ParallelxError(_worker_message(str(exc))) from None
    finally:
        bar.close()
    result = sums.compute(backend)
    result["seconds"] = time.perf_counter() - start
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


def fit(backend: Backend, model: nn.Module, optimizer: Any, train_set: Dataset, val_set: Dataset,
        cfg: FitConfig, *, run_info: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train for ``cfg.epochs``; write ``best.pth``, ``last.pth``, ``history.csv``,
    ``metrics.json`` and ``training_results.png`` into ``cfg.out_dir``.
    Returns the final metrics (on every rank)."""
    criterion = nn.CrossEntropyLoss(reduction="none")
    train_loader = _loader(backend, train_set, cfg, train=True)
    val_loader = _loader(backend, val_set, cfg, train=False)
    micro = len(train_loader) if cfg.max_steps is None else min(len(train_loader), cfg.max_steps)
    steps_per_epoch = math.ceil(micro / backend.options.accumulate)
    scheduler = make_scheduler(optimizer, cfg.lr_schedule, steps=steps_per_epoch * cfg.epochs,
                               warmup_steps=round(cfg.warmup_epochs * steps_per_epoch))
    out = Path(cfg.out_dir)
    _make_out_dir(backend, out)
    history: list[dict[str, float]] = []
    best_acc, best_epoch = -1.0, 0
    since = time.perf_counter()
    backend.print(f"backend={backend.name} world_size={backend.world_size} device={backend.device} "
                  f"train={len(train_set)} val={len(val_set)} batch/process={cfg.batch_size} "
                  f"workers/process={train_loader.num_workers} {_loop_summary(backend, cfg)}")
    for epoch in range(1, cfg.epochs + 1):
        backend.print(f"Epoch {epoch}/{cfg.epochs}\n" + "-" * 10)
        tr = run_epoch(backend, model, train_loader, criterion, optimizer=optimizer, scheduler=scheduler,
                       desc=f"train {epoch}", max_steps=cfg.max_steps)
        backend.print(f"train Loss: {tr['loss']:.4f} Acc: {tr['acc']:.4f} lr: {tr['lr']:.6g} "
                      f"grad norm: {tr['grad_norm']:.4f}" + (f" skipped steps: {tr['skipped']}" if tr["skipped"] else ""))
        if not math.isfinite(tr["loss"]):  # all-reduced: every rank stops together
            raise ParallelxError(f"the training loss is {tr['loss']} in epoch {epoch}: the weights diverged; "
                                 "lower --lr and run again")
        va = run_epoch(backend, model, val_loader, criterion, desc=f"val {epoch}")
        backend.print(f"val Loss: {va['loss']:.4f} Acc: {va['acc']:.4f}")
        history.append({
            "epoch": epoch, "train_loss": tr["loss"], "train_acc": tr["acc"], "val_loss": va["loss"],
            "val_acc": va["acc"], "epoch_time_s": tr["seconds"] + va["seconds"],
            "train_images_per_s": tr["count"] / tr["seconds"], "val_images_per_s": va["count"] / va["seconds"],
            "lr": tr["lr"], "grad_norm": tr["grad_norm"], "optimizer_steps": tr["steps"], "skipped_steps": tr["skipped"],
        })
        # val acc is all-reduced, so every rank takes this branch together:
        # the save below is collective and must be called by all of them.
        if va["acc"] > best_acc:
            best_acc, best_epoch = va["acc"], epoch
            backend.save(model, out / "best.pth")
        if backend.is_main():
            _write_history(out, history)
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
        _plot(out / "training_results.png", history)
    backend.print(f"Training complete in {int(total // 60)}m {int(total % 60)}s")
    backend.print(f"Best val Acc: {best_acc:.4f}")
    backend.print(f"outputs in {out.resolve()}")
    backend.barrier()
    return metrics


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
