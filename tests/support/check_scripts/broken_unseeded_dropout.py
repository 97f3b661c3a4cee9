"""Dropout from an unseeded generator: the model's weights are seeded (inside
fork_rng), the random numbers of the training are not, so every run draws
other dropout masks.

    python -m parallelx check -- tests/support/check_scripts/broken_unseeded_dropout.py
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import parallelx


def main() -> None:
    parser = argparse.ArgumentParser()
    parallelx.add_arguments(parser)
    args = parser.parse_args()
    with parallelx.from_args(args) as backend:
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(512, 20, generator=g), torch.randint(0, 3, (512,), generator=g))
        with torch.random.fork_rng():  # the mistake: the seed stays inside
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 3))
        model, optimizer = backend.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        loader = DataLoader(data, batch_size=16, sampler=backend.make_sampler(data, seed=0))
        for x, y in backend.batches(loader):
            loss = nn.functional.cross_entropy(model(x.to(backend.device)), y.to(backend.device))
            backend.backward(loss)
            backend.step(optimizer)


if __name__ == "__main__":
    main()
