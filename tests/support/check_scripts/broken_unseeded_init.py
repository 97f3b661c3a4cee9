"""Initial weights from an unseeded generator: every run starts elsewhere
(the ranks of one run agree, since the backend broadcasts rank 0's).

    python -m parallelx check -- tests/support/check_scripts/broken_unseeded_init.py
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
        g = torch.Generator().manual_seed(1)  # the data is seeded ...
        data = TensorDataset(torch.randn(512, 20, generator=g), torch.randint(0, 3, (512,), generator=g))
        model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 3))  # ... the mistake: the model is not
        model, optimizer = backend.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        loader = DataLoader(data, batch_size=16, sampler=backend.make_sampler(data, seed=0))
        for x, y in backend.batches(loader):
            loss = nn.functional.cross_entropy(model(x.to(backend.device)), y.to(backend.device))
            backend.backward(loss)
            backend.step(optimizer)


if __name__ == "__main__":
    main()
