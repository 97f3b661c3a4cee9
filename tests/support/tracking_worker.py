"""A training script that uses only parallelx's public API and logs through
``backend.log_metrics``: LeNet on seeded random CIFAR-sized data, under any
launcher (``tests/launcher/test_tracking_launch.py``)::

    torchrun --nproc-per-node 2 tests/support/tracking_worker.py --backend ddp --logger tensorboard,mlflow,csv \
        --logger-dir RUN --record RUN/record.json

Its own record (``--record``, written by rank 0) holds what the trackers must
show: the mean training loss over the ranks at every optimizer step, the
validation loss of every epoch, how many samples were trained and how long
the training passes took.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root goes first (recipes.models)
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import parallelx
from recipes.models import LeNet


def datasets(seed: int, train: int, val: int) -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(train + val, 3, 32, 32, generator=g)
    y = torch.randint(10, (train + val,), generator=g)
    return TensorDataset(x[:train], y[:train]), TensorDataset(x[train:], y[train:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parallelx.add_arguments(parser)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--train-size", type=int, default=256)
    parser.add_argument("--record", type=Path, required=True)
    args = parser.parse_args()

    with parallelx.from_args(args) as backend:
        parallelx.seed_everything(0)
        train_set, val_set = datasets(0, args.train_size, 61)
        model = LeNet()
        model, optimizer = backend.setup(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        sampler = backend.make_sampler(train_set, shuffle=True, seed=0)
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
        val_sampler = backend.make_sampler(val_set, shuffle=False)
        val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler)
        criterion = nn.CrossEntropyLoss(reduction="none")
        record: dict[str, list[float] | float | int] = {"train_loss": [], "val_loss": []}
        step, samples, train_s = 0, 0, 0.0
        for epoch in range(1, args.epochs + 1):
            model.train()
            start = time.perf_counter()
            for x, y in backend.batches(loader):
                x, y = x.to(backend.device), y.to(backend.device)
                with backend.autocast():
                    loss = criterion(model(x), y).mean()
                backend.backward(loss)
                if backend.step(optimizer) is not None:
                    step += 1
                    backend.log_metrics(
                        {"train/loss": loss, "lr": optimizer.param_groups[0]["lr"]}, reduce={"train/loss": "mean"}
                    )
                    # The script's own figure, read at once (a test may synchronise; the call above did not).
                    record["train_loss"].append(backend.all_reduce(loss.detach().double(), "mean").item())  # type: ignore[union-attr]
                samples += int(backend.all_reduce(torch.tensor(len(x)), "sum"))
            train_s += time.perf_counter() - start
            model.eval()
            val = parallelx.MetricSums(val_sampler)
            with torch.no_grad():
                for x, y in val_loader:
                    x, y = x.to(backend.device), y.to(backend.device)
                    out = model(x)
                    val.update(criterion(out.float(), y), out.argmax(1) == y)
            v = val.compute(backend)
            backend.log_metrics({"val_loss": v["loss"], "val_acc": v["acc"]}, step=epoch)
            record["val_loss"].append(v["loss"])  # type: ignore[union-attr]
        record.update(steps=step, samples=samples, train_s=train_s, world_size=backend.world_size)
        if backend.is_main():
            args.record.parent.mkdir(parents=True, exist_ok=True)
            args.record.write_text(json.dumps(record))


if __name__ == "__main__":
    main()
