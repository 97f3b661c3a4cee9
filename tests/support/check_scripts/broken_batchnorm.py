"""BatchNorm statistics computed on each rank's own shard: before fine-tuning,
the script recalibrates the running statistics on a few of its batches, then
trains with BatchNorm frozen (normalising with those statistics).  Each rank
normalises with statistics of its own data.

    python -m parallelx check -- tests/support/check_scripts/broken_batchnorm.py
"""

import argparse
import itertools

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import parallelx


def freeze_batchnorm(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.BatchNorm1d):
            m.eval()


def main() -> None:
    parser = argparse.ArgumentParser()
    parallelx.add_arguments(parser)
    args = parser.parse_args()
    with parallelx.from_args(args) as backend:
        parallelx.seed_everything(0)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(512, 20, generator=g) * torch.linspace(0.5, 3, 20) + 1.0
        data = TensorDataset(x, torch.randint(0, 3, (512,), generator=g))
        model = nn.Sequential(nn.Linear(20, 32), nn.BatchNorm1d(32, momentum=None), nn.ReLU(), nn.Linear(32, 3))
        model, optimizer = backend.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        loader = DataLoader(data, batch_size=16, sampler=backend.make_sampler(data, seed=0))
        model.train()
        with torch.no_grad():  # the mistake: statistics from this rank's batches only
            for xb, _ in itertools.islice(loader, 4):
                model(xb.to(backend.device))
        freeze_batchnorm(model)
        for xb, yb in backend.batches(loader):
            loss = nn.functional.cross_entropy(model(xb.to(backend.device)), yb.to(backend.device))
            backend.backward(loss)
            backend.step(optimizer)


if __name__ == "__main__":
    main()
