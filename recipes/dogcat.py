"""Dogs-vs-Cats: fine-tune torchvision's VGG16 with a 2-class head, on any backend.

    python -m recipes.dogcat --backend single --data-dir data/dogcat --image-size 64
    python -m recipes.dogcat --backend dp --data-dir data/dogcat
    torchrun --nproc-per-node 2 -m recipes.dogcat --backend ddp --data-dir data/dogcat
    horovodrun -np 2 python -m recipes.dogcat --backend horovod --data-dir data/dogcat
    deepspeed --num_gpus 2 recipes/dogcat.py --backend deepspeed --data-dir data/dogcat
    torchrun --nproc-per-node 2 -m recipes.dogcat --backend fsdp --data-dir data/dogcat

``--data-dir`` holds Kaggle's ``train/`` folder (``cat.0.jpg``, ``dog.0.jpg``, ...),
optionally with ``train.csv`` (``filename,label``).  80 % trains, 20 % validates
(fixed split).  ``--pretrained`` starts from torchvision's ImageNet weights
(downloaded where the network allows), ``--weights PATH`` from a local file,
``--freeze-features`` trains only the classifier.  Unreadable image files are
skipped with a warning that counts them.

VGG16 has 138 M parameters: on 2 CPU cores expect ~10 images/s at
``--image-size 64``; on GPUs use 224 and a batch of 32 per GPU.  Batch
arithmetic: ``--batch-size`` is per process, so the global batch is
``batch_size x world_size`` (x ``--accumulate``).

The training loop is :func:`train`, below: the epochs, the batches, the
backward pass and the optimizer step, validation, the checkpoints.  The
helpers it calls hold the command line (``common.py``), the data
(``data.py``), the model (``models.py``) and the files written at the end
(``history.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import sys
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as a file (the deepspeed launcher does): be the package module all the same
    _folder = Path(__file__).resolve().parent
    # Python put this folder first on sys.path, where data.py, models.py, ...
    # would shadow any top-level module of those names; the repository root goes there instead.
    sys.path[:] = [str(_folder.parent), *(p for p in sys.path if Path(p or ".").resolve() != _folder)]
    import recipes  # noqa: F401  (the package the relative imports below resolve in)

    __package__ = "recipes"

import torch
from torch import nn
from torch.utils.data import Dataset
from tqdm import tqdm

import parallelx
from parallelx import Backend, MetricSums, ParallelxError
from parallelx.utils import threads_per_process

from .common import base_parser, find_checkpoint, fraction, make_scheduler, recipe_state, validate
from .data import list_dogcat, load_dogcat, make_loader, split_indices
from .history import epoch_row, final_metrics, make_out_dir, write_history, write_outputs
from .models import (
    VGG16_MAX_IMAGE_SIZE,
    VGG16_MIN_IMAGE_SIZE,
    check_vgg_image_size,
    imagenet_vgg16_state,
    read_vgg16_weights,
    vgg16_for_dogcat,
)

RECIPE = "dogcat"


def image_size(text: str) -> int:
    """argparse type: an image size VGG16 can take."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer number of pixels, got {text!r}") from None
    try:
        check_vgg_image_size(value)
    except ParallelxError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--image-size ")) from None
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = base_parser(
        f"python -m {__package__}.dogcat", "Dogs-vs-Cats with VGG16", epochs=3, batch_size=16, lr=0.001
    )
    parser.add_argument(
        "--image-size",
        type=image_size,
        default=224,
        metavar="SIZE",
        help=f"images are resized to SIZE x SIZE, {VGG16_MIN_IMAGE_SIZE} to {VGG16_MAX_IMAGE_SIZE}",
    )
    parser.add_argument("--pretrained", action="store_true", help="start from torchvision's ImageNet weights")
    parser.add_argument(
        "--weights",
        type=Path,
        default=None,
        help="start from a local VGG16 state dict (default: torchvision's random initialisation, unless --pretrained)",
    )
    parser.add_argument("--freeze-features", action="store_true", help="train the classifier only")
    parser.add_argument("--val-fraction", type=fraction, default=0.2, help="share of the images that validates")
    return parser


def starting_weights(args: argparse.Namespace) -> dict[str, torch.Tensor] | None:
    """The VGG16 weights to start from: ImageNet's (``--pretrained``), a file's
    (``--weights``), or None for torchvision's random initialisation."""
    if args.pretrained:
        return imagenet_vgg16_state()
    if args.weights is not None:
        return read_vgg16_weights(args.weights)
    return None


@parallelx.exit_on_error
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.pretrained and args.weights is not None:
        raise ParallelxError("use either --pretrained or --weights PATH, not both")
    # Everything that can be checked without decoding images or joining a
    # process group is checked first: the backend's own options (a DeepSpeed
    # config file) when it is built, the paths, the listing of the data and
    # whether it splits, the starting weights.
    backend = parallelx.from_args(args)
    args.out_dir = args.out_dir or Path("runs") / f"dogcat-{backend.name}"
    validate(args)
    split_indices(len(list_dogcat(args.data_dir)[0]), args.val_fraction, args.seed)
    start = starting_weights(args)

    with backend:  # released on every rank when anything below raises
        parallelx.seed_everything(args.seed)  # same initial weights on every rank
        train_set, val_set = load_dogcat(
            args.data_dir,
            args.image_size,
            val_fraction=args.val_fraction,
            seed=args.seed,
            threads=threads_per_process(backend.local_world_size),
        )
        attempts = itertools.count()

        def attempt() -> None:
            # Called again in the new world after a lost rank (horovodrun --min-np):
            # then from the seed, the starting weights read again, and the latest checkpoint.
            nonlocal start
            weights = start
            start = None  # the model holds its own copy
            if next(attempts):
                parallelx.seed_everything(args.seed)
                args.resume = "auto"
                weights = starting_weights(args)
            train(backend, args, train_set, val_set, weights)

        backend.run_elastic(attempt)
    return 0


def train(
    backend: Backend,
    args: argparse.Namespace,
    train_set: Dataset,
    val_set: Dataset,
    weights: dict[str, torch.Tensor] | None,
) -> None:
    """Fine-tune from ``weights`` (None: torchvision's random initialisation)
    for ``--epochs``; write ``best.pth``, ``last.pth``, ``history.csv``,
    ``metrics.json`` and ``training_results.png`` into ``--out-dir``, and with
    ``--checkpoint-every`` or ``--resume``, training-state checkpoints under
    ``OUT_DIR/checkpoints/``.  Every rank runs all of it."""
    model = vgg16_for_dogcat(weights=weights, freeze_features=args.freeze_features)
    trainable = [p for p in model.parameters() if p.requires_grad]  # the classifier only, with --freeze-features
    optimizer = torch.optim.SGD(trainable, lr=args.lr, momentum=args.momentum)
    model, optimizer = backend.setup(model, optimizer)
    criterion = nn.CrossEntropyLoss(reduction="none")  # per-sample losses, as MetricSums wants them

    # This rank's shard of each split, reshuffled every epoch.  Training batches
    # are (x, y, index): each image's random flip is seeded by (seed, epoch, index), so
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

    # The loop's own state, which a checkpoint stores besides the weights: the
    # epoch in progress and how far it got, its partial sums, the history.
    state: dict[str, Any] = {
        "recipe": RECIPE,
        "epoch": 1,  # the epoch in progress; epochs + 1 when all are done
        "global_step": 0,
        "history": [],
        "best_acc": -1.0,
        "best_epoch": 0,
        # the epoch in progress: micro-batches and optimizer steps done, its partial sums
        "batches": 0,
        "steps": 0,
        "skipped": 0,
        "norm_sum": 0.0,
        "seconds": 0.0,
        "train_sums": None,
    }
    checkpointing = args.checkpoint_every is not None or args.resume is not None
    path = find_checkpoint(backend, args.resume, out_dir)
    if path is not None:
        info = parallelx.load_training_state(
            backend, path, model=model, optimizer=optimizer, scheduler=scheduler, sampler=train_sampler
        )
        state, where = recipe_state(info, path, RECIPE, args.epochs)
        backend.print(f"resuming from {path}: {where}")

    def save_checkpoint(consumed: int) -> None:
        """A training-state checkpoint (a collective): weights, optimizer, schedule, the
        sampler's position (``consumed`` samples of this rank's pass) and ``state``."""
        saved = parallelx.save_training_state(
            backend,
            out_dir,
            step=state["global_step"],
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            sampler=train_sampler.state_dict(consumed=consumed),
            counters={"epoch": state["epoch"], "global_step": state["global_step"]},
            keep=args.keep_checkpoints,
            extra=state,
        )
        backend.print(
            f"checkpoint {saved}: epoch {state['epoch']}, micro-batch {state['batches']}, step {state['global_step']}"
        )
        backend.elastic_commit()  # an elastic run that loses a rank goes back to this checkpoint

    def preempted() -> None:
        why = preempt.signal.name if preempt.signal is not None else "a stop request on another rank"
        backend.print(
            f"preempted ({why}): checkpoint written at epoch {state['epoch']}, step {state['global_step']}; "
            "run the same command with --resume auto to continue"
        )
        backend.barrier()

    preempt = parallelx.Preemption()  # SIGTERM: every rank saves at the next step, then stops
    with preempt if checkpointing else contextlib.nullcontext():
        while state["epoch"] <= args.epochs:
            epoch = state["epoch"]
            backend.print(f"Epoch {epoch}/{args.epochs}\n" + "-" * 10)

            # ---- train: this rank's shard (the rest of it, in an epoch a checkpoint cut)
            model.train()
            train_sums = MetricSums(train_sampler)  # leaves the sampler's padding duplicates out
            if state["train_sums"] is not None:
                train_sums.load_state_dict(state["train_sums"], backend)
            norm_sum = torch.tensor(state["norm_sum"], device=backend.device)
            start, done, seconds = time.perf_counter(), state["batches"], state["seconds"]  # before this pass
            limit = (
                len(train_loader) if args.max_steps is None else min(len(train_loader), max(1, args.max_steps - done))
            )
            batches = backend.batches(train_loader, limit=limit)  # accumulation windows, as many on every rank
            bar = tqdm(batches, total=limit, desc=f"train {epoch}", disable=not backend.is_main(), leave=False)
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
                state["global_step"] += 1
                state["steps"] += 1
                state["skipped"] += int(result.skipped)
                norm_sum += result.grad_norm.to(norm_sum.device)
                # To the trackers of --logger (nothing without one): the step's last micro-batch, every rank's mean.
                backend.log_metrics(
                    {"train/loss": losses.mean().detach(), "lr": optimizer.param_groups[0]["lr"]},
                    step=state["global_step"],
                    reduce={"train/loss": "mean"},
                )
                if not checkpointing or i + 1 == limit:  # the pass's last step: the epoch's checkpoint follows
                    continue
                stop = preempt.should_stop(backend)  # a collective: every rank, every step
                if stop or (args.checkpoint_every and state["global_step"] % args.checkpoint_every == 0):
                    state.update(
                        batches=done + i + 1,
                        norm_sum=float(norm_sum),
                        seconds=seconds + time.perf_counter() - start,
                        train_sums=train_sums.state_dict(backend),  # every rank's sums
                    )
                    save_checkpoint(consumed=min((i + 1) * args.batch_size, train_sampler.num_samples))
                if stop:
                    preempted()
                    return
            bar.close()
            t = train_sums.compute(backend)  # a collective: the global figures, each sample once
            t.update(
                seconds=seconds + time.perf_counter() - start,
                lr=optimizer.param_groups[0]["lr"],
                steps=state["steps"],
                skipped=state["skipped"],
                grad_norm=float(norm_sum) / max(1, state["steps"]),
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

            # ---- the epoch's outputs: history, best.pth, a checkpoint
            state["history"].append(epoch_row(epoch, t, v))
            # The same line to --logger's trackers (nothing without one); "lr" is logged at every step.
            backend.log_metrics({k: x for k, x in state["history"][-1].items() if k != "lr"}, step=state["global_step"])
            # val acc is all-reduced, so every rank takes this branch together: save is a collective.
            if v["acc"] > state["best_acc"]:
                state["best_acc"], state["best_epoch"] = v["acc"], epoch
                backend.save(model, out_dir / "best.pth")
            if backend.is_main():
                write_history(out_dir, state["history"])
            state.update(epoch=epoch + 1, batches=0, steps=0, skipped=0, norm_sum=0.0, seconds=0.0, train_sums=None)
            if checkpointing:
                # The pass is over (or cut by --max-steps): the next epoch starts at its beginning.
                save_checkpoint(consumed=train_sampler.num_samples)
                if preempt.should_stop(backend):
                    preempted()
                    return

    backend.save(model, out_dir / "last.pth")  # the weights after the last step, a plain state_dict (collective)
    total = time.perf_counter() - since
    if backend.is_main():
        metrics = final_metrics(
            backend,
            args,
            state["history"],
            best_acc=state["best_acc"],
            best_epoch=state["best_epoch"],
            total_s=total,
            run_info={"recipe": RECIPE, "model": "vgg16", "image_size": args.image_size},
        )
        write_outputs(out_dir, metrics, state["history"])
    backend.print(f"Training complete in {int(total // 60)}m {int(total % 60)}s")
    backend.print(f"Best val Acc: {state['best_acc']:.4f}")
    backend.print(f"outputs in {out_dir.resolve()}")
    backend.barrier()


if __name__ == "__main__":
    sys.exit(main())
