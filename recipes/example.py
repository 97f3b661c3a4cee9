"""The loop you write yourself, on any backend: a small MLP on a seeded synthetic set made in memory.

    python -m recipes.example --backend single
    torchrun --nproc-per-node 2 -m recipes.example --backend ddp
    horovodrun -np 2 -H localhost:2 --gloo python -m recipes.example --backend horovod
    deepspeed --num_gpus 2 recipes/example.py --backend deepspeed --zero-stage 0

Rank 0 prints a line per epoch (with 2 processes, the last is ``epoch 2/2: train
loss 0.4355 | val loss 0.4146 acc 0.8367 (210/251)``) and writes ``--out``, read by
``torch.load(path, weights_only=True)``.  ``--batch-size`` is per process: the
global batch is batch_size x world_size.  10-30 s on 2 CPU cores, mostly start-up.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

if not __package__:  # run as a file (the deepspeed launcher does): the repository root, not recipes/, goes first
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import parallelx

FEATURES, CLASSES = 32, 4


def make_datasets(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """1,000 training and 251 validation points (odd: 2 ranks' shards get padded) around fixed class centres."""
    centres = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(CLASSES, (1251,), generator=g)
    x = centres[y] + 2.5 * torch.randn(len(y), FEATURES, generator=g)
    return TensorDataset(x[:1000], y[:1000]), TensorDataset(x[1000:], y[1000:])


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, CLASSES))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parallelx.add_arguments(parser)  # --backend, --device, the loop's options, DeepSpeed's (and its --local_rank)
    parser.add_argument("--epochs", type=int, default=2, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per process per step")
    parser.add_argument("--lr", type=float, default=0.1, help="peak learning rate (cosine schedule to 0)")
    parser.add_argument("--out", type=Path, default=Path("example.pth"), help="the file written at the end")
    parser.add_argument("--seed", type=int, default=0, help="data, initial weights and shuffle")
    args = parser.parse_args(argv)

    with parallelx.from_args(args) as backend:  # released on every rank, even when training raises
        parallelx.seed_everything(args.seed)  # the same initial weights on every rank
        train_set, val_set = make_datasets(args.seed)
        model = make_model()
        model, optimizer = backend.setup(model, torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9))
        sampler = backend.make_sampler(train_set, shuffle=True, seed=args.seed)  # a new shuffle every epoch
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
        val_sampler = backend.make_sampler(val_set, shuffle=False)
        val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler)
        steps = args.epochs * math.ceil(len(loader) / backend.options.accumulate)  # optimizer steps in all
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)  # on the wrapped optimizer
        criterion = nn.CrossEntropyLoss(reduction="none")  # per-sample losses, as MetricSums wants them

        for epoch in range(1, args.epochs + 1):
            model.train()
            train = parallelx.MetricSums(sampler)  # leaves the sampler's padding duplicates out
            for x, y in backend.batches(loader):  # accumulation windows, the same batch count on every rank
                x, y = x.to(backend.device), y.to(backend.device)
                with backend.autocast():
                    out = model(x)
                    losses = criterion(out, y)
                backend.backward(losses.mean())
                backend.step(optimizer, scheduler)  # at a window's end: average, clip, step, schedule, zero
                train.update(losses.detach(), out.argmax(1) == y)

            model.eval()
            val = parallelx.MetricSums(val_sampler)
            with torch.no_grad(), backend.autocast():
                for x, y in val_loader:
                    x, y = x.to(backend.device), y.to(backend.device)
                    out = model(x)
                    val.update(criterion(out.float(), y), out.argmax(1) == y)
            t, v = train.compute(backend), val.compute(backend)  # collectives: every rank calls them
            backend.print(
                f"epoch {epoch}/{args.epochs}: train loss {t['loss']:.4f} | val loss {v['loss']:.4f} "
                f"acc {v['acc']:.4f} ({v['correct']}/{v['count']})"
            )

        # Every rank calls save (gathering sharded state is collective); rank 0 writes the file.
        backend.save({"model": model, "optimizer": optimizer, "epochs": args.epochs}, args.out)
        backend.print(f"saved {args.out}")


if __name__ == "__main__":
    main()
