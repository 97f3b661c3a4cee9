"""The optimizer stepped on rank 0 only (as if it were logging), in the protocol form.

python -m parallelx check -- tests/support/check_scripts/broken_step_on_main.py
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
        parallelx.seed_everything(0)
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(512, 20, generator=g), torch.randint(0, 3, (512,), generator=g))
        model = backend.wrap_model(nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 3)))
        optimizer = backend.wrap_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
        loader = DataLoader(data, batch_size=16, sampler=backend.make_sampler(data, seed=0))
        for step, (x, y) in enumerate(loader):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x.to(backend.device)), y.to(backend.device))
            backend.backward(loss)
            if backend.is_main():  # the mistake: the update belongs to every rank
                optimizer.step()
                print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
