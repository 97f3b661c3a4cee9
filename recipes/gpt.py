"""A character-level GPT (nanoGPT's model) trained on a text file, on any backend.

    python -m recipes.gpt --backend single
    torchrun --nproc-per-node 2 -m recipes.gpt --backend ddp
    torchrun --nproc-per-node 2 -m recipes.gpt --backend fsdp
    horovodrun -np 2 python -m recipes.gpt --backend horovod
    deepspeed --num_gpus 2 recipes/gpt.py --backend deepspeed --zero-stage 2
    torchrun --nproc-per-node 2 -m recipes.gpt --backend ddp --data-dir data/text \\
        --accumulate 2 --clip-grad-norm 1.0 --precision bf16-mixed
    torchrun --nproc-per-node 2 --max-restarts 3 -m recipes.gpt --backend ddp \\
        --checkpoint-every 50 --resume auto       # restarted after a failure, it continues from a checkpoint

Data: ``--data-dir`` holds ``input.txt`` (nanoGPT's name; any UTF-8 text, e.g.
its tiny Shakespeare); every distinct character is a token.  Without
``--data-dir`` the recipe trains on a text generated from ``--seed``, the one
``python -m recipes.make_data text --out DIR`` writes.  The first 90 % of the
text trains (``--val-fraction``), cut into windows of ``--block-size + 1``
characters, one every ``--block-size``: an epoch reads the text once.

The model: token and position embeddings, ``--n-layer`` pre-LayerNorm blocks
of causal self-attention and MLP, dropout, an output layer tied to the token
embedding (``recipes/models.py``).  AdamW with nanoGPT's two groups (2-D
weights decay, biases and LayerNorms do not); a linear warm-up of
``--warmup-steps`` optimizer steps, then a cosine down to ``--min-lr``.
Accumulation, clipping and mixed precision are the backend's own options
(``--accumulate``, ``--clip-grad-norm``, ``--precision bf16-mixed``).
Validation runs on every rank over its shard (the exact mean loss over the
validation windows); at the end every rank generates ``--sample-tokens``
characters with the same seed (under ZeRO-3 and fsdp the forward is a
collective) and rank 0 prints them.

Batch arithmetic: ``--batch-size`` sequences of ``--block-size`` characters per
process and micro-batch, so an optimizer step takes ``batch_size x block_size
x world_size x accumulate`` tokens: 32 x 64 x 2 = 4,096 with the defaults on 2
processes (under ``--tensor-parallel N`` a group of N processes reads one batch: world_size / N).  Hardware and time: the defaults (0.46 M parameters, 150,000
generated characters, 3 epochs: 99 optimizer steps at 2 processes) are sized
for 2 CPU cores, ``torchrun --nproc-per-node 2 -m recipes.gpt --backend ddp``:
about a minute on idle cores (1 to 2 minutes measured on a shared 2-core
machine under a load of 6 to 8); the validation loss falls from ln(32) = 3.47
to 1.51 and the sample reads as the generated text's words, half spelled.  On
a GPU raise the model and the batch (nanoGPT's Shakespeare: ``--n-layer 6
--n-head 6 --n-embd 384 --block-size 256 --batch-size 64 --lr 1e-3``).

The training loop is :func:`train`, below.  Outputs in ``--out-dir``:
``last.pth``, ``best.pth`` (the lowest validation loss), ``history.csv``,
``metrics.json`` (with the vocabulary and the sample), ``training_results.png``,
and with ``--checkpoint-every`` or ``--resume``, ``checkpoints/``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from dataclasses import asdict
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
from torch.nn import functional as F
from tqdm import tqdm

import parallelx
from parallelx import Backend, MetricSums, ParallelxError, storage

from .common import (
    base_parser,
    fraction,
    learning_rate,
    make_scheduler,
    non_negative_float,
    non_negative_int,
    positive_int,
    proportion,
    resume,
    validate,
)
from .data import CharWindows, char_datasets, make_loader, read_text
from .history import make_out_dir, plot, run_config, shown, write_history
from .make_data import generate_text
from .models import GPT, GPTConfig, gpt_param_groups

RECIPE = "gpt"


def build_parser() -> argparse.ArgumentParser:
    parser = base_parser(
        f"python -m {__package__}.gpt",
        "A character-level GPT on a text file",
        epochs=3,
        batch_size=32,
        lr=4e-3,
        sgd=False,
        sample="sequences of --block-size characters",
        lr_help="peak learning rate, reached after --warmup-steps; then a cosine down to --min-lr",
        data_help="a folder holding input.txt, the text to train on (default: a text generated from --seed, "
        "as `python -m recipes.make_data text` writes it)",
        num_workers_help="data-loader workers per process; the windows are slices of one tensor in memory, "
        "so loading them in the training process is fastest",
        num_workers=0,
    )
    parser.add_argument("--block-size", type=positive_int, default=64, help="the context: characters per sequence")
    parser.add_argument("--n-layer", type=positive_int, default=4, help="transformer blocks")
    parser.add_argument("--n-head", type=positive_int, default=4, help="attention heads per block")
    parser.add_argument("--n-embd", type=positive_int, default=96, help="width of the embeddings and blocks")
    parser.add_argument("--dropout", type=proportion, default=0.1, help="dropout probability, in [0, 1)")
    parser.add_argument(
        "--weight-decay",
        type=non_negative_float,
        default=0.1,
        help="AdamW's decay of the 2-D weights (biases and LayerNorm weights are not decayed)",
    )
    parser.add_argument("--beta2", type=fraction, default=0.99, help="AdamW's second-moment decay")
    parser.add_argument("--warmup-steps", type=non_negative_int, default=10, help="optimizer steps of linear warm-up")
    parser.add_argument(
        "--min-lr",
        type=learning_rate,
        default=None,
        help="the learning rate at the end of the cosine (default: --lr / 10)",
    )
    parser.add_argument(
        "--val-fraction", type=fraction, default=0.1, help="the share at the end of the text that validates"
    )
    parser.add_argument(
        "--generated-chars", type=positive_int, default=150_000, help="length of the generated text, without --data-dir"
    )
    parser.add_argument(
        "--sample-tokens", type=non_negative_int, default=200, help="characters generated at the end (0: none)"
    )
    return parser


@parallelx.exit_on_error
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Everything that can be checked without joining a process group is checked
    # first: the backend's own options, the paths, the text and the model's shape.
    backend = parallelx.from_args(args)
    args.out_dir = args.out_dir or Path("runs") / f"gpt-{backend.name}"
    validate(args)
    args.min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    if args.min_lr > args.lr:
        raise ParallelxError(f"--min-lr {args.min_lr} is above --lr {args.lr}; the cosine goes down to it")
    text = generate_text(args.generated_chars, args.seed) if args.data_dir is None else read_text(args.data_dir)
    train_set, val_set, vocab = char_datasets(text, args.block_size, args.val_fraction)
    config = GPTConfig(
        vocab_size=len(vocab),
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=args.dropout,
    )

    with backend:  # released on every rank when anything below raises
        attempts = itertools.count()

        def attempt() -> None:
            # Called again in the new world after a lost rank (horovodrun --min-np):
            # then from the latest checkpoint if there is one.
            if next(attempts):
                args.resume = "auto"
            train(backend, args, config, train_set, val_set, vocab)

        backend.run_elastic(attempt)
    return 0


def sequence_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each sequence's mean loss over its characters, shape [B]: MetricSums
    counts sequences, and with sequences of equal length the mean of these is
    the mean over the characters."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets).mean(1)


def train(
    backend: Backend,
    args: argparse.Namespace,
    config: GPTConfig,
    train_set: CharWindows,
    val_set: CharWindows,
    vocab: list[str],
) -> None:
    """Train for ``--epochs``; write ``best.pth``, ``last.pth``, ``history.csv``,
    ``metrics.json`` and ``training_results.png`` into ``--out-dir``, and with
    ``--checkpoint-every`` or ``--resume``, training-state checkpoints under
    ``OUT_DIR/checkpoints/``.  Every rank runs all of it."""
    parallelx.seed_everything(args.seed)  # the same initial weights on every rank
    model = GPT(config)
    parameters = sum(p.numel() for p in model.parameters())  # the tied weight once
    groups = gpt_param_groups(model, args.weight_decay)
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, args.beta2))
    model, optimizer = backend.setup(model, optimizer)
    # Dropout draws its own masks on each rank (nanoGPT's seed offset), the same
    # on every backend whatever its set-up drew from the generator.
    torch.manual_seed(args.seed + 1000 * backend.rank)

    # This rank's shard of the windows, reshuffled every epoch; validation in order.
    train_sampler = backend.make_sampler(train_set, shuffle=True, seed=args.seed)
    val_sampler = backend.make_sampler(val_set, shuffle=False)
    loader_options = {"batch_size": args.batch_size, "num_workers": args.num_workers, "seed": args.seed}
    train_loader = make_loader(backend, train_set, train_sampler, **loader_options)
    val_loader = make_loader(backend, val_set, val_sampler, **loader_options)
    micro_batches = min(len(train_loader), args.max_steps or len(train_loader))  # per epoch and rank
    total_steps = math.ceil(micro_batches / backend.options.accumulate) * args.epochs  # optimizer steps
    if args.warmup_steps >= total_steps:
        parallelx.warn(
            f"--warmup-steps {args.warmup_steps} is not below this run's {total_steps} optimizer steps: "
            "the learning rate never reaches --lr"
        )
    # Warm-up then cosine, stepped once per optimizer step by backend.step (never per micro-batch or process).
    scheduler = make_scheduler(
        optimizer, "cosine", steps=total_steps, warmup_steps=args.warmup_steps, floor=args.min_lr / args.lr
    )
    # Every data-parallel rank's micro-batch (a tensor-parallel group reads one).
    tokens_per_batch = args.batch_size * args.block_size * backend.mesh.data_size
    out_dir = args.out_dir
    make_out_dir(backend, out_dir)
    since = time.perf_counter()
    o = backend.options
    backend.print(
        f"backend={backend.name} world_size={backend.world_size} device={backend.device} "
        f"parameters={parameters / 1e6:.2f}M vocab={len(vocab)} train={len(train_set)}x{args.block_size} "
        f"val={len(val_set)}x{args.block_size} batch/process={args.batch_size} accumulate={o.accumulate} "
        f"clip_grad_norm={o.clip_grad_norm} precision={o.precision} optimizer_steps={total_steps} "
        f"tokens/step={tokens_per_batch * o.accumulate}"
    )

    # What a checkpoint holds, by name: the parts, the epoch's sums (leaving the
    # sampler's padding duplicates out) and figures, and the run's own values.
    train_sums = MetricSums(train_sampler)  # loss only
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
        recipe=RECIPE,
        history=[],
        best_loss=math.inf,
        best_epoch=0,
    )
    resume(ckpt, args.resume, RECIPE)  # --resume: auto, a path, or a fresh start

    with ckpt:  # with checkpoints on, SIGTERM: every rank saves at the next step, then stops
        for epoch in ckpt.epochs(args.epochs):
            backend.print(f"Epoch {epoch}/{args.epochs}\n" + "-" * 10)

            # ---- train: this rank's shard (the rest of it, in an epoch a checkpoint cut)
            model.train()
            start = time.perf_counter()
            batches = ckpt.batches(train_loader, limit=args.max_steps)  # accumulation windows, as many on every rank
            bar = tqdm(batches, desc=f"train {epoch}", disable=not backend.is_main(), leave=False)
            for i, (x, y) in enumerate(bar):
                x, y = x.to(backend.device, non_blocking=True), y.to(backend.device, non_blocking=True)
                with backend.autocast():
                    losses = sequence_losses(model(x), y)
                backend.backward(losses.mean())
                result = backend.step(optimizer, scheduler)  # None inside an accumulation window
                train_sums.update(losses, None)
                if backend.is_main() and i % 10 == 0:  # .item() waits for the GPU: rarely, on one rank
                    tokens_s = (i + 1) * tokens_per_batch / (time.perf_counter() - start)
                    bar.set_postfix(loss=f"{losses.mean().item():.4f}", tok_s=f"{tokens_s:,.0f}")
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
            t = train_sums.compute(backend)  # a collective: the global mean, each window once
            train_seconds = ckpt.epoch_seconds
            lr, grad_norm = optimizer.param_groups[0]["lr"], float(ckpt["norm_sum"]) / max(1, ckpt.epoch_steps)
            backend.print(
                f"train loss: {t['loss']:.4f} lr: {lr:.6g} grad norm: {grad_norm:.4f} "
                f"tokens/s: {t['count'] * args.block_size / train_seconds:,.0f}"
                + (f" skipped steps: {ckpt['skipped']}" if ckpt["skipped"] else "")
            )
            if not math.isfinite(t["loss"]):  # all-reduced: every rank stops together
                raise ParallelxError(
                    f"the training loss is {t['loss']} in epoch {epoch}: the weights diverged; lower --lr and run again"
                )

            # ---- validate: every rank its shard, so the loss is one process's over the whole set
            model.eval()
            val_sums = MetricSums(val_sampler)
            start = time.perf_counter()
            with torch.no_grad(), backend.autocast():
                for x, y in tqdm(val_loader, desc=f"val {epoch}", disable=not backend.is_main(), leave=False):
                    x, y = x.to(backend.device, non_blocking=True), y.to(backend.device, non_blocking=True)
                    val_sums.update(sequence_losses(model(x), y), None)
            v = val_sums.compute(backend)
            val_seconds = time.perf_counter() - start
            backend.print(f"val loss: {v['loss']:.4f} (perplexity {math.exp(v['loss']):.2f})")

            # ---- the epoch's outputs: history, best.pth (the epoch's checkpoint follows, in ckpt.epochs)
            ckpt["history"].append(
                {
                    "epoch": epoch,
                    "train_loss": t["loss"],
                    "val_loss": v["loss"],
                    "epoch_time_s": train_seconds + val_seconds,
                    "train_tokens_per_s": t["count"] * args.block_size / train_seconds,
                    "val_tokens_per_s": v["count"] * args.block_size / val_seconds,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "optimizer_steps": ckpt.epoch_steps,
                    "skipped_steps": ckpt["skipped"],
                }
            )
            # The same line to --logger's trackers (nothing without one); "lr" is logged at every step.
            backend.log_metrics({k: x for k, x in ckpt["history"][-1].items() if k != "lr"}, step=ckpt.global_step)
            # The val loss is all-reduced, so every rank takes this branch together: save is a collective.
            if v["loss"] < ckpt["best_loss"]:
                ckpt["best_loss"], ckpt["best_epoch"] = v["loss"], epoch
                backend.save(model, storage.join(out_dir, "best.pth"))
            if backend.is_main():
                write_history(out_dir, ckpt["history"])
    if ckpt.preempted:  # at an epoch's end
        return

    backend.save(
        model, storage.join(out_dir, "last.pth")
    )  # the weights after the last step, a plain state_dict (collective)
    sample = ""
    if args.sample_tokens:
        context = val_set.tokens[:1].view(1, 1).to(backend.device)  # the validation text's first character
        generated = generate(backend, model, context, args.sample_tokens, args.block_size, seed=args.seed)
        sample = "".join(vocab[i] for i in generated[0].tolist())
        backend.print(f"sample:\n{sample}\n")
    total = time.perf_counter() - since
    if backend.is_main():
        history = ckpt["history"]
        metrics = {
            "best_val_loss": ckpt["best_loss"],
            "best_epoch": ckpt["best_epoch"],
            **final_metrics(backend, args, history, total),
            "model": {"name": "GPT", "parameters": parameters, **asdict(config)},
            "vocab": "".join(vocab),
            "sample": sample,
        }
        storage.write_text(storage.join(out_dir, "metrics.json"), json.dumps(metrics, indent=2) + "\n")
        plot(storage.join(out_dir, "training_results.png"), history)
    backend.print(f"Training complete in {int(total // 60)}m {int(total % 60)}s")
    backend.print(f"Best val loss: {ckpt['best_loss']:.4f} (epoch {ckpt['best_epoch']})")
    backend.print(f"outputs in {shown(out_dir)}")
    backend.barrier()


def final_metrics(
    backend: Backend, args: argparse.Namespace, history: list[dict[str, Any]], total: float
) -> dict[str, Any]:
    """What ``metrics.json`` holds of the run besides the best epoch, the model and the sample."""
    return {
        "final_val_loss": history[-1]["val_loss"],
        "final_train_loss": history[-1]["train_loss"],
        "total_time_s": total,
        "backend": backend.name,
        "world_size": backend.world_size,
        "train_tokens_per_s": sum(h["train_tokens_per_s"] for h in history) / len(history),
        "config": {
            **run_config(args),
            **{k: getattr(args, k) for k in ("lr", "min_lr", "warmup_steps", "weight_decay", "beta2")},
            "data_dir": None if args.data_dir is None else str(args.data_dir),
            "generated_chars": None if args.data_dir is not None else args.generated_chars,
            "val_fraction": args.val_fraction,
        },
        "loop": asdict(backend.options),
        "recipe": RECIPE,
    }


@torch.no_grad()
def generate(
    backend: Backend,
    model: nn.Module,
    context: torch.Tensor,
    new_tokens: int,
    block_size: int,
    *,
    seed: int,
    temperature: float = 0.8,
) -> torch.Tensor:
    """``context`` (token ids, [1, T]) followed by ``new_tokens`` sampled ones.
    Every rank runs it with the same seed: the same forwards in the same
    order (under ZeRO-3 and fsdp each forward gathers the weights, a
    collective), and the same text."""
    model.eval()
    generator = torch.Generator(device=backend.device).manual_seed(seed)
    ids = context
    for _ in range(new_tokens):
        with backend.autocast():
            logits = model(ids[:, -block_size:])[:, -1, :]
        probs = F.softmax(logits.float() / temperature, dim=-1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], dim=1)
    return ids


if __name__ == "__main__":
    sys.exit(main())
