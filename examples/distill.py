"""Distillation on every backend: a frozen teacher (no optimizer,
``requires_grad=False``, eval mode) beside a student that is itself partly
frozen (the teacher's encoder, frozen, with trainable low-rank adapters and a
head of its own).  The frozen weights are neither all-reduced nor in the
optimizer's state.  See docs/several-models.md.

    python examples/distill.py --out-dir runs/distill
    torchrun --nproc-per-node 2 examples/distill.py --backend ddp --out-dir runs/distill
    deepspeed --num_gpus 2 examples/distill.py --backend deepspeed --zero-stage 2 --out-dir runs/distill
    horovodrun -np 2 python examples/distill.py --backend horovod --out-dir runs/distill

The global batch is ``--batch-size`` whatever the world size: every backend and
one process compute the same numbers.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import parallelx

CLASSES = 10


class Student(nn.Module):
    """A frozen encoder (the teacher's) with trainable low-rank adapters beside it, and a small head."""

    def __init__(self, encoder: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.encoder = copy.deepcopy(encoder).requires_grad_(False)
        self.down = nn.Linear(encoder.in_features, rank, bias=False)
        self.up = nn.Linear(rank, encoder.out_features, bias=False)
        nn.init.zeros_(self.up.weight)  # the adapters start as a no-op
        self.head = nn.Linear(encoder.out_features, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.encoder(x) + self.up(self.down(x))))


def arguments() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parallelx.add_arguments(p)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32, help="the global batch (every rank's together)")
    p.add_argument("--temperature", type=float, default=2.0)
    p.add_argument("--out-dir", type=Path, default=Path("runs/distill"))
    return p


def train(backend: parallelx.Backend, args: argparse.Namespace) -> None:
    parallelx.seed_everything(0)
    teacher = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, CLASSES))
    student = Student(teacher[0])
    teacher.requires_grad_(False).eval()

    teacher, _ = backend.setup(teacher)  # run only: no optimizer, no gradient sync
    trainable = [p for p in student.parameters() if p.requires_grad]
    student, optimizer = backend.setup(student, torch.optim.AdamW(trainable, lr=3e-3))

    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(512, 16, generator=g))
    sampler = backend.make_sampler(data, shuffle=True, seed=2)
    loader = DataLoader(data, batch_size=args.batch_size // backend.world_size, sampler=sampler, drop_last=True)
    t = args.temperature
    for epoch in range(args.epochs):
        for (x,) in backend.batches(loader):
            x = x.to(backend.device)
            with torch.no_grad():
                soft = F.softmax(teacher(x) / t, dim=1)
            loss = F.kl_div(F.log_softmax(student(x) / t, dim=1), soft, reduction="batchmean") * t * t
            backend.backward(loss)
            backend.step(optimizer)
        backend.print(f"epoch {epoch}: distillation loss {loss.item():.5f}")

    state = backend.named_optimizer_state(student, optimizer)["state"]
    backend.print(f"optimizer state holds {sorted(state)} (the frozen encoder is not there)")
    backend.save({"student": student, "teacher": teacher}, args.out_dir / "final.pt")


def main() -> None:
    args = arguments().parse_args()
    with parallelx.from_args(args) as backend:
        train(backend, args)


if __name__ == "__main__":
    main()
