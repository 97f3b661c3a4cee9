"""``tests/support/ds_tutorial_original.py`` (DeepSpeed's CIFAR-10 tutorial in miniature) ported to
parallelx as docs/from-deepspeed.md tells a DeepSpeed user: the config's ``optimizer`` section becomes
``torch.optim.AdamW`` (DeepSpeed's ``Adam`` is AdamW), its ``WarmupLR`` a ``LambdaLR`` of the same
factors, ``gradient_clipping`` ``clip_grad_norm``, ``train_batch_size`` the per-rank batch times the
world size, ``--stage`` ``zero_stage`` (the backends without ZeRO ignore it), and
``engine.backward/step`` ``backend.backward/step``; the script keeps its own ``--local_rank``.

    deepspeed --num_gpus 2 tests/support/ds_tutorial_port.py --backend deepspeed --stage 1 --moe --out DIR
    torchrun --nproc-per-node 2 tests/support/ds_tutorial_port.py --backend ddp --out DIR

Rank 0 writes ``DIR/final.pt`` (``backend.save``: every expert under ``--moe``).  With
``--resume-check`` the run also saves its state halfway (``backend.save`` of the model and the
optimizer, and the optimizer's state by name), trains on, then builds the model again, loads that
state both ways and trains the second half again: ``DIR/halfway.pt`` and ``DIR/resumed-*.pt`` hold
what the test compares with ``final.pt``.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import parallelx

STEPS = 8
TRAIN_BATCH_SIZE = 16
WARMUP_MIN_LR, WARMUP_MAX_LR, WARMUP_NUM_STEPS = 0.0, 0.001, 4


def add_argument() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--stage", default=0, type=int, choices=[0, 1, 2, 3])
    parser.add_argument("--moe", default=False, action="store_true")
    parser.add_argument("--ep-world-size", default=2, type=int)
    parser.add_argument("--num-experts", default=2, type=int)
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume-check", action="store_true")
    parallelx.add_arguments(parser)
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.moe = args.moe
        if self.moe:
            import deepspeed

            fc3 = nn.Linear(84, 84)
            self.moe_layer_list = nn.ModuleList(
                [
                    deepspeed.moe.layer.MoE(
                        hidden_size=84, expert=fc3, num_experts=args.num_experts, ep_size=args.ep_world_size, k=1
                    )
                ]
            )
            self.fc4 = nn.Linear(84, 10)
        else:
            self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        if self.moe:
            for layer in self.moe_layer_list:
                x, _, _ = layer(x)
            return self.fc4(x)
        return self.fc3(x)


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    images = torch.randn(STEPS * TRAIN_BATCH_SIZE, 3, 32, 32, generator=g)
    labels = (images.flatten(1) @ torch.randn(3 * 32 * 32, 10, generator=g)).argmax(1)
    return TensorDataset(images, labels)


def warmup_lr(step: int) -> float:
    """DeepSpeed's WarmupLR (log warm-up) as a LambdaLR factor of warmup_max_lr: its first two steps at the
    minimum (it sets it when built, and its first step computes log(1) = 0)."""
    warm = max(2, WARMUP_NUM_STEPS)
    gamma = 0.0 if step == 0 else (math.log(step) / math.log(warm) if step - 1 < warm else 1.0)
    return (WARMUP_MIN_LR + (WARMUP_MAX_LR - WARMUP_MIN_LR) * gamma) / WARMUP_MAX_LR


def build(args: argparse.Namespace, backend: parallelx.Backend) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    net = Net(args)
    parameters: list = [p for p in net.parameters() if p.requires_grad]
    if args.moe:  # as the original: DeepSpeed's ZeRO 1 and 2 take the experts in groups of their own
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        parameters = split_params_into_different_moe_groups_for_optimizer({"params": parameters, "name": "parameters"})
    optimizer = torch.optim.AdamW(parameters, lr=WARMUP_MAX_LR, betas=(0.8, 0.999), eps=1e-8, weight_decay=3e-7)
    model, optimizer = backend.setup(net, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_lr)
    return model, optimizer, scheduler


def train(backend, model, optimizer, scheduler, batches) -> list[tuple[float, float]]:
    """Each step's loss and gradient norm (before clipping)."""
    criterion = nn.CrossEntropyLoss()
    figures = []
    for inputs, labels in batches:
        outputs = model(inputs.to(backend.device))
        loss = criterion(outputs, labels.to(backend.device))
        backend.backward(loss)
        result = backend.step(optimizer, scheduler)
        figures.append((loss.item(), result.grad_norm.item()))
    return figures


def main(args: argparse.Namespace) -> None:
    with parallelx.from_args(args, zero_stage=args.stage, clip_grad_norm=1.0) as backend:
        data = make_data()
        loader = DataLoader(
            data,
            batch_size=TRAIN_BATCH_SIZE // backend.world_size,
            sampler=backend.make_sampler(data, shuffle=True, seed=0),
        )
        model, optimizer, scheduler = build(args, backend)
        # Iterated after the set-up, as the original's loop does: a DataLoader's iterator takes a seed
        # from torch's generator, whose next numbers the MoE gate's random token selection draws.
        batches = list(loader)
        half = len(batches) // 2
        losses = train(backend, model, optimizer, scheduler, batches[:half])
        if args.resume_check:
            backend.save(
                {
                    "model": model,
                    "optimizer": optimizer,
                    "named_optimizer": backend.named_optimizer_state(model, optimizer),
                    "scheduler": scheduler.state_dict(),
                    "rng": torch.get_rng_state(),  # the gate's random token selection draws from it
                },
                os.path.join(args.out, "halfway.pt"),
            )
        losses += train(backend, model, optimizer, scheduler, batches[half:])
        backend.save({"model": model, "figures": losses}, os.path.join(args.out, "final.pt"))
        if not args.resume_check:
            return
        saved = backend.load(os.path.join(args.out, "halfway.pt"))
        for form in ("positional", "named"):
            model, optimizer, scheduler = build(args, backend)
            backend.load_state_dict(model, saved["model"])
            if form == "positional":
                backend.load_state_dict(optimizer, saved["optimizer"])
            else:
                backend.load_named_optimizer_state(model, optimizer, saved["named_optimizer"])
            scheduler.load_state_dict(saved["scheduler"])
            torch.set_rng_state(saved["rng"])
            train(backend, model, optimizer, scheduler, batches[half:])
            backend.save(model, os.path.join(args.out, f"resumed-{form}.pt"))
        backend.print("Finished Training")


if __name__ == "__main__":
    main(add_argument())
