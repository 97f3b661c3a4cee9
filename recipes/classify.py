"""The training loop of the image recipes (``cifar10.py``: LeNet; ``dogcat.py``: VGG16).

:func:`train` is the loop a user writes: the epochs, the batches, the backward
pass and the optimizer step, validation, and the outputs (``history.csv``,
``best.pth``, ``last.pth``, ``metrics.json``, the plot).  What it takes to
resume exactly and to stop on a preemption is :class:`parallelx.Checkpointer`'s:
a few lines below.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset
from tqdm import tqdm

import parallelx
from parallelx import Backend, MetricSums, ParallelxError, storage

from .common import make_scheduler, resume
from .data import make_loader
from .history import epoch_row, final_metrics, make_out_dir, shown, write_history, write_outputs


def train(
    backend: Backend,
    args: argparse.Namespace,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_set: Dataset,
    val_set: Dataset,
    *,
    recipe: str,
    run_info: dict[str, Any],
) -> None:
    """Train ``model`` for ``--epochs``; write ``best.pth``, ``last.pth``, ``history.csv``,
    ``metrics.json`` (with ``run_info``) and ``training_results.png`` into ``--out-dir``,
    and with ``--checkpoint-every`` or ``--resume``, training-state checkpoints under
    ``OUT_DIR/checkpoints/``.  Every rank runs all of it."""
    model, optimizer = backend.setup(model, optimizer)
    criterion = nn.CrossEntropyLoss(reduction="none")  # per-sample losses, as MetricSums wants them

    # This rank's shard of each split, reshuffled every epoch.  Training batches
    # are (x, y, index): each image's flip is seeded by (seed, epoch, index), so
    # that a resumed run, at any world size, sees the images this one would have.
    train_sampler = backend.make_sampler(train_set, shuffle=True, seed=args.seed)
    val_sampler = backend.make_sampler(val_set, shuffle=False)
    loader_options = {"batch_size": args.batch_size, "num_workers": args.num_workers, "seed": args.seed}
    train_loader = make_loader(backend, train_set, train_sampler, seeded_augmentation=True, **loader_options)
    val_loader = make_loader(backend, val_set, val_sampler, **loader_options)
    micro_batches = min(len(train_loader), args.max_steps or len(train_loader))  # per epoch and rank
    steps_per_epoch = math.ceil(micro_batches / backend.options.accumulate)  # optimizer steps
    scheduler = make_scheduler(
        optimizer,
        args.lr_schedule,
        steps=steps_per_epoch * args.epochs,
        warmup_steps=round(args.warmup_epochs * steps_per_epoch),
    )
    out_dir = args.out_dir
    make_out_dir(backend, out_dir)
    since = time.perf_counter()
    o = backend.options
    backend.print(
        f"backend={backend.name} world_size={backend.world_size} device={backend.device} "
        f"train={len(train_set)} val={len(val_set)} batch/process={args.batch_size} "
        f"workers/process={train_loader.num_workers} accumulate={o.accumulate} clip_grad_norm={o.clip_grad_norm} "
        f"precision={o.precision} grad_compression={o.grad_compression} lr_schedule={args.lr_schedule} "
        f"warmup_epochs={args.warmup_epochs}"
    )

    # What a checkpoint holds, by name: the parts, the epoch's sums (leaving the
    # sampler's padding duplicates out) and figures, and the run's own values.
    train_sums = MetricSums(train_sampler)
    ckpt = parallelx.Checkpointer(
        backend,
        out_dir,
        every=args.checkpoint_every,
        keep=args.keep_checkpoints,
        asynchronous=args.checkpoint_async,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        sampler=train_sampler,
        train_sums=train_sums,
        per_epoch={"skipped": 0, "norm_sum": torch.zeros((), device=backend.device)},
        recipe=recipe,
        history=[],
        best_acc=-1.0,
        best_epoch=0,
    )
    resume(ckpt, args.resume, recipe)  # --resume: auto, a path, or a fresh start

    with ckpt:  # with checkpoints on, SIGTERM: every rank saves at the next step, then stops
        for epoch in ckpt.epochs(args.epochs):
            backend.print(f"Epoch {epoch}/{args.epochs}\n" + "-" * 10)

            # ---- train: this rank's shard (the rest of it, in an epoch a checkpoint cut)
            model.train()
            batches = ckpt.batches(train_loader, limit=args.max_steps)  # accumulation windows, as many on every rank
            bar = tqdm(batches, desc=f"train {epoch}", disable=not backend.is_main(), leave=False)
            for i, (x, y, _) in enumerate(bar):
                x, y = x.to(backend.device, non_blocking=True), y.to(backend.device, non_blocking=True)
                with backend.autocast():
                    out = model(x)
                    losses = criterion(out, y)
                backend.backward(losses.mean())
                result = backend.step(optimizer, scheduler)  # None inside an accumulation window
                train_sums.update(losses, out.argmax(1) == y)
                if backend.is_main() and i % 10 == 0:  # .item() waits for the GPU: rarely, on one rank
                    bar.set_postfix(loss=f"{losses.mean().item():.4f}")
                if result is None:
                    continue
                ckpt["skipped"] += int(result.skipped)
                ckpt["norm_sum"] += result.grad_norm.to(backend.device)
                stop = ckpt.step()  # a checkpoint when --checkpoint-every is due or on a preemption
                # To the trackers of --logger (nothing without one): the step's last micro-batch, every rank's mean.
                backend.log_metrics(
                    {"train/loss": losses.mean().detach(), "lr": optimizer.param_groups[0]["lr"]},
                    step=ckpt.global_step,
                    reduce={"train/loss": "mean"},
                )
                if stop:  # preempted: saved on every rank
                    return
            bar.close()
            t = train_sums.compute(backend)  # a collective: the global figures, each sample once
            t.update(
                seconds=ckpt.epoch_seconds,
                lr=optimizer.param_groups[0]["lr"],
                steps=ckpt.epoch_steps,
                skipped=ckpt["skipped"],
                grad_norm=float(ckpt["norm_sum"]) / max(1, ckpt.epoch_steps),
            )
            backend.print(
                f"train Loss: {t['loss']:.4f} Acc: {t['acc']:.4f} lr: {t['lr']:.6g} grad norm: {t['grad_norm']:.4f}"
                + (f" skipped steps: {t['skipped']}" if t["skipped"] else "")
            )
            if not math.isfinite(t["loss"]):  # all-reduced: every rank stops together
                raise ParallelxError(
                    f"the training loss is {t['loss']} in epoch {epoch}: the weights diverged; lower --lr and run again"
                )

            # ---- validate: every rank its shard, so the figures are one process's over the whole set
            model.eval()
            val_sums = MetricSums(val_sampler)
            start = time.perf_counter()
            with torch.no_grad(), backend.autocast():
                for x, y in tqdm(val_loader, desc=f"val {epoch}", disable=not backend.is_main(), leave=False):
                    x, y = x.to(backend.device, non_blocking=True), y.to(backend.device, non_blocking=True)
                    out = model(x)
                    val_sums.update(criterion(out, y), out.argmax(1) == y)
            v = val_sums.compute(backend)
            v["seconds"] = time.perf_counter() - start
            backend.print(f"val Loss: {v['loss']:.4f} Acc: {v['acc']:.4f}")

            # ---- the epoch's outputs: history, best.pth (the epoch's checkpoint follows, in ckpt.epochs)
            ckpt["history"].append(epoch_row(epoch, t, v))
            # The same line to --logger's trackers (nothing without one); "lr" is logged at every step.
            backend.log_metrics({k: x for k, x in ckpt["history"][-1].items() if k != "lr"}, step=ckpt.global_step)
            # val acc is all-reduced, so every rank takes this branch together: save is a collective.
            if v["acc"] > ckpt["best_acc"]:
                ckpt["best_acc"], ckpt["best_epoch"] = v["acc"], epoch
                backend.save(model, storage.join(out_dir, "best.pth"))
            if backend.is_main():
                write_history(out_dir, ckpt["history"])
    if ckpt.preempted:  # at an epoch's end
        return

    backend.save(
        model, storage.join(out_dir, "last.pth")
    )  # the weights after the last step, a plain state_dict (collective)
    total = time.perf_counter() - since
    if backend.is_main():
        metrics = final_metrics(
            backend,
            args,
            ckpt["history"],
            best_acc=ckpt["best_acc"],
            best_epoch=ckpt["best_epoch"],
            total_s=total,
            run_info=run_info,
        )
        write_outputs(out_dir, metrics, ckpt["history"])
    backend.print(f"Training complete in {int(total // 60)}m {int(total % 60)}s")
    backend.print(f"Best val Acc: {ckpt['best_acc']:.4f}")
    backend.print(f"outputs in {shown(out_dir)}")
    backend.barrier()
