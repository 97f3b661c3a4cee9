"""A script in the style of DeepSpeed's CIFAR-10 tutorial (DeepSpeedExamples,
``training/cifar/cifar10_deepspeed.py``), run under plain DeepSpeed: a config dict with
``train_batch_size``, an ``Adam`` optimizer section, a ``WarmupLR`` scheduler section,
``gradient_clipping``, the fp16 loss-scaler keys (off: the CPU has no fp16 engine), ZeRO from its
own ``--stage``, an optional MoE layer (``--moe``), its own ``--local_rank``; the tutorial's net on
small seeded data made in memory, a few steps.  ``tests/support/ds_tutorial_port.py`` is the same
script ported to parallelx; ``tests/launcher/test_ds_tutorial.py`` compares their weights.

    deepspeed --num_gpus 2 tests/support/ds_tutorial_original.py --stage 1 --moe --out DIR

Each rank writes ``DIR/rank<r>.pt``: its ``state_dict`` (under ``--moe`` its own experts, under
DeepSpeed's local keys) and the losses.
"""

from __future__ import annotations

import argparse
import os

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from torch import nn
from torch.utils.data import TensorDataset

STEPS = 8
TRAIN_BATCH_SIZE = 16


def add_argument() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--stage", default=0, type=int, choices=[0, 1, 2, 3])
    parser.add_argument("--moe", default=False, action="store_true")
    parser.add_argument("--ep-world-size", default=2, type=int)
    parser.add_argument("--num-experts", default=2, type=int)
    parser.add_argument("--out", required=True)
    return parser.parse_args()


def get_ds_config(args: argparse.Namespace) -> dict:
    return {
        "train_batch_size": TRAIN_BATCH_SIZE,
        "steps_per_print": 2000,
        "optimizer": {
            "type": "Adam",
            # torch's AdamW (DeepSpeed's Adam is AdamW unless adam_w_mode is false): its fused Adam is a GPU op.
            "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7, "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 4},
        },
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": False},
        "fp16": {
            "enabled": False,
            "fp16_master_weights_and_grads": False,
            "loss_scale": 0,
            "loss_scale_window": 500,
            "hysteresis": 2,
            "min_loss_scale": 1,
            "initial_scale_power": 15,
        },
        "wall_clock_breakdown": False,
        "zero_optimization": {
            "stage": args.stage,
            "allgather_partitions": True,
            "reduce_scatter": True,
            "allgather_bucket_size": 50000000,
            "reduce_bucket_size": 50000000,
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
    }


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
    """CIFAR-sized images whose class a fixed random projection decides: learnable, seeded, in memory."""
    g = torch.Generator().manual_seed(1234)
    images = torch.randn(STEPS * TRAIN_BATCH_SIZE, 3, 32, 32, generator=g)
    labels = (images.flatten(1) @ torch.randn(3 * 32 * 32, 10, generator=g)).argmax(1)
    return TensorDataset(images, labels)


def main(args: argparse.Namespace) -> None:
    deepspeed.init_distributed()
    torch.manual_seed(0)
    net = Net(args)
    parameters = [p for p in net.parameters() if p.requires_grad]
    if args.moe:  # the tutorial's --moe-param-group: ZeRO 1 and 2 need the experts in groups of their own
        parameters = split_params_into_different_moe_groups_for_optimizer({"params": parameters, "name": "parameters"})
    model_engine, _, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=make_data(), config=get_ds_config(args)
    )
    criterion = nn.CrossEntropyLoss()
    losses = []
    for inputs, labels in trainloader:
        outputs = model_engine(inputs.to(model_engine.device))
        loss = criterion(outputs, labels.to(model_engine.device))
        model_engine.backward(loss)
        model_engine.step()
        losses.append(loss.item())
    with deepspeed.zero.GatheredParameters(list(net.parameters()), enabled=args.stage == 3):
        state = {k: v.detach().clone().cpu() for k, v in net.state_dict().items()}
    os.makedirs(args.out, exist_ok=True)
    torch.save({"model": state, "losses": losses}, os.path.join(args.out, f"rank{torch.distributed.get_rank()}.pt"))
    if not args.moe:  # DeepSpeed's own checkpoint folder, as the tutorial saves it (read by parallelx as weights)
        model_engine.save_checkpoint(os.path.join(args.out, "checkpoints"))
    print("Finished Training")


if __name__ == "__main__":
    main(add_argument())
