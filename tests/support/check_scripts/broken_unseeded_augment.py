"""Augmentation drawn from NumPy's generator, which the script never seeds
(it seeds torch only): each run, and each rank, jitters its inputs differently.

    python -m parallelx check -- tests/support/check_scripts/broken_unseeded_augment.py
"""

import argparse

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import parallelx


class Jittered(Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 20, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        noise = torch.from_numpy(np.random.normal(0, 0.1, 20).astype(np.float32))  # the mistake: np unseeded
        return self.x[i] + noise, self.y[i]


def main() -> None:
    parser = argparse.ArgumentParser()
    parallelx.add_arguments(parser)
    args = parser.parse_args()
    with parallelx.from_args(args) as backend:
        torch.manual_seed(0)
        data = Jittered(512)
        model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 3))
        model, optimizer = backend.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        loader = DataLoader(data, batch_size=16, sampler=backend.make_sampler(data, seed=0))
        for x, y in backend.batches(loader):
            loss = nn.functional.cross_entropy(model(x.to(backend.device)), y.to(backend.device))
            backend.backward(loss)
            backend.step(optimizer)


if __name__ == "__main__":
    main()
