"""A script in the style of DeepSpeed's CIFAR-10 tutorial (DeepSpeedExamples, training/cifar):
its own ``--local_rank`` and ``--stage``, DeepSpeed's ``add_config_arguments`` then parallelx's
options, a config file from ``--deepspeed_config``, and its own AdamW with a warm-up from lr 0
written as a torch scheduler.  Launched by tests/launcher/test_deepspeed_config_launch.py as the
tutorial is, ``deepspeed train.py --deepspeed --deepspeed_config ds_config.json --stage 2``."""

from __future__ import annotations

import argparse

import deepspeed
import torch
from torch import nn

import parallelx


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--stage", type=int, default=0, choices=(0, 1, 2, 3))
    parser = deepspeed.add_config_arguments(parser)
    parallelx.add_arguments(parser)
    args = parser.parse_args()
    backend = parallelx.from_args(args, zero_stage=args.stage)
    with backend:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.999), eps=1e-8, weight_decay=3e-7)
        model, optimizer = backend.setup(model, optimizer)
        # The script's own warm-up, from lr 0 on purpose: legal, and its base lr is the optimizer's.
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, s / 2))
        lrs = []
        g = torch.Generator().manual_seed(1 + backend.rank)
        for _ in range(4):
            x, y = torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
            lrs.append(optimizer.param_groups[0]["lr"])
            backend.backward(nn.functional.cross_entropy(model(x), y))
            backend.step(optimizer, scheduler)
        final = backend.unwrap(model).state_dict()
        moved = max(float((final[k].float() - initial[k]).abs().max()) for k in initial)
        assert lrs == [0.0, 5e-4, 1e-3, 1e-3], lrs
        assert moved > 1e-5, f"the weights did not move ({moved})"
        if backend.rank == 0:
            print(f"trained: zero stage {backend.strategy.zero_stage}, lrs {lrs}, largest change {moved:.3g}")


if __name__ == "__main__":
    main()
