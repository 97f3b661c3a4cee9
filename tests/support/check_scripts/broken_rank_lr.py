"""A learning rate that depends on the rank (someone "scaling" it by hand).

python -m parallelx check -- tests/support/check_scripts/broken_rank_lr.py
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import parallelx


def main() -> None:
    parser = argparse.ArgumentParser()
    parallelx.add_arguments(parser)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    with parallelx.from_args(args) as backend:
        parallelx.seed_everything(0)
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(512, 20, generator=g), torch.randint(0, 3, (512,), generator=g))
        model = nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 3))
        lr = args.lr * (1 + 0.5 * backend.rank)  # the mistake: each rank steps with its own rate
        model, optimizer = backend.setup(model, torch.optim.SGD(model.parameters(), lr=lr))
        loader = DataLoader(data, batch_size=args.batch_size, sampler=backend.make_sampler(data, seed=0))
        for epoch in range(2):
            for x, y in backend.batches(loader):
                loss = nn.functional.cross_entropy(model(x.to(backend.device)), y.to(backend.device))
                backend.backward(loss)
                backend.step(optimizer)
            backend.print(f"epoch {epoch} done")


if __name__ == "__main__":
    main()
