"""Run under a launcher (2 processes): the ranks part ways in one of seven ways a user writes by
mistake (``--part``), after a few training steps; every rank must print the same verdict naming
the rank, the call and this script's line (``tests/launcher/test_hangs.py``).  The line of each
divergence carries a ``# PART:<name>`` mark, which the test looks up."""

from __future__ import annotations

import argparse
import sys
import time
from collections import OrderedDict
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import parallelx

PARTS = ("eval", "save", "branch", "shapes", "raise", "sleep", "bucket")


def main() -> None:
    p = argparse.ArgumentParser()
    parallelx.add_arguments(p)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--part", choices=PARTS, required=True)
    args = p.parse_args()
    with parallelx.from_args(args) as backend:
        torch.manual_seed(0)
        # Named as an MLP's layers, so that --tensor-parallel splits them: a forward is then a collective.
        layers = OrderedDict(fc1=nn.Linear(4, 8), act=nn.ReLU(), fc2=nn.Linear(8, 2))
        model = backend.wrap_model(nn.Sequential(layers))
        opt = backend.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = torch.randn(3, 4).to(backend.device), torch.tensor([0, 1, 0]).to(backend.device)

        def train_step() -> None:
            backend.backward(nn.functional.cross_entropy(model(x), y))
            backend.step(opt)

        for _ in range(3):
            train_step()
        rank, part = backend.rank, args.part
        print(f"parting at {time.time():.3f}", flush=True)  # the test's clock of the hang, past start-up
        if part == "eval":  # nanoGPT's habit: evaluate on rank 0 only
            if backend.is_main:
                model.eval()
                with torch.no_grad():
                    loss = model(x).sum()  # PART:eval (a sharded model's forward is a collective)
                print("val", backend.all_reduce(loss, "mean").item())  # PART:eval (ddp: the reduction is)
                model.train()
            backend.broadcast(torch.zeros(2))
        elif part == "save":
            if backend.is_main:
                backend.save(model, args.out / "model.pt")  # PART:save
            backend.barrier()
        elif part == "branch":
            if rank == 0:
                backend.all_reduce(torch.ones(3))  # PART:branch
            backend.barrier()
        elif part == "shapes":
            backend.all_reduce(torch.ones(3 + 2 * rank))  # PART:shapes
        elif part == "raise":
            if rank == 1:
                raise RuntimeError("this rank failed on purpose")  # PART:raise
            backend.all_reduce(torch.ones(3))
        elif part == "sleep":
            if rank == 1:
                time.sleep(600)  # PART:sleep
            backend.all_reduce(torch.ones(3))
        elif part == "bucket":  # inside the loop: rank 0's all_reduce meets the engine's gradient reduction
            for _ in range(2):
                if rank == 0:
                    backend.all_reduce(torch.ones(3))  # PART:bucket
                train_step()
        train_step()
        backend.print("finished")


if __name__ == "__main__":
    main()
