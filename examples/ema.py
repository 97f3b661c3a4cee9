"""An exponential moving average of the weights on every backend: kept beside
the model as it is sharded (each rank averages its own share under fsdp and
ZeRO-3), updated every ``--ema-every`` steps, evaluated, saved whole.  A
hand-written average (any elementwise ``multi_avg_fn``) runs beside torch's.
See docs/several-models.md.

    python examples/ema.py --out-dir runs/ema
    torchrun --nproc-per-node 2 examples/ema.py --backend fsdp --out-dir runs/ema
    deepspeed --num_gpus 2 examples/ema.py --backend deepspeed --zero-stage 3 --out-dir runs/ema
    horovodrun -np 2 python examples/ema.py --backend horovod --out-dir runs/ema

The global batch is ``--batch-size`` whatever the world size: every backend and
one process compute the same numbers.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import parallelx


def polyak(averaged: Sequence[torch.Tensor], current: Sequence[torch.Tensor], n_averaged: torch.Tensor) -> None:
    """A hand-written average: ``averaged += 0.05 * (current - averaged)``, elementwise (it runs on each shard)."""
    for a, c in zip(averaged, current):
        a.add_(c - a, alpha=0.05)


def arguments() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parallelx.add_arguments(p)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="the global batch (every rank's together)")
    p.add_argument("--ema-decay", type=float, default=0.99)
    p.add_argument("--ema-every", type=int, default=2)
    p.add_argument("--out-dir", type=Path, default=Path("runs/ema"))
    return p


def train(backend: parallelx.Backend, args: argparse.Namespace) -> None:
    parallelx.seed_everything(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 8, generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    train_set, val = TensorDataset(x[:384], y[:384]), TensorDataset(x[384:], y[384:])
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    model, optimizer = backend.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    ema = parallelx.EMA(backend, model, decay=args.ema_decay, every=args.ema_every)
    hand = parallelx.EMA(backend, model, multi_avg_fn=polyak)

    sampler = backend.make_sampler(train_set, shuffle=True, seed=2)
    loader = DataLoader(train_set, batch_size=args.batch_size // backend.world_size, sampler=sampler, drop_last=True)
    loss_fn = nn.MSELoss()
    for epoch in range(args.epochs):
        model.train()
        for xb, yb in backend.batches(loader):
            backend.backward(loss_fn(model(xb.to(backend.device)), yb.to(backend.device)))
            if backend.step(optimizer) is not None:
                ema.update()  # averages every --ema-every steps
                hand.update()
        model.eval()
        xv, yv = val.tensors[0].to(backend.device), val.tensors[1].to(backend.device)
        with torch.no_grad():
            plain = loss_fn(model(xv), yv)
            with ema.swapped():  # the model with the averaged weights, its own again after the block
                averaged = loss_fn(model(xv), yv)
            by_hand = loss_fn(hand(xv), yv)  # a forward with the averaged weights
        backend.print(
            f"epoch {epoch}: val loss {plain.item():.5f}, EMA {averaged.item():.5f}, hand-written {by_hand.item():.5f}"
        )
    # Plain state dicts of the model: torch.load them into the unwrapped model on any backend.
    backend.save(
        {"model": model, "ema": ema.model_state_dict(), "hand": hand.model_state_dict()},
        args.out_dir / "final.pt",
    )


def main() -> None:
    args = arguments().parse_args()
    with parallelx.from_args(args) as backend:
        train(backend, args)


if __name__ == "__main__":
    main()
