"""The benchmark workload in plain PyTorch DDP, written as the PyTorch DDP
tutorial shows it (no parallelx).

``benchmarks.run`` starts it under the ``ddp`` backend's launcher (torchrun).

Model, optimizer, the tutorial's training step, synthetic data, seeds and
timing come from ``benchmarks.workload`` so that the work equals
``px_worker --backend ddp``; everything distributed below is plain
``torch.distributed``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks import workload


def prepare(case: workload.Case, device: torch.device, local_rank: int) -> tuple[workload.Step, nn.Module]:
    """The DDP-wrapped model and its optimizer, as a training step (and the bare model)."""
    model = workload.build_model(case).to(device)
    ddp_model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = workload.make_optimizer(ddp_model, case)
    return workload.torch_step(ddp_model, optimizer), model


@workload.exit_on_bench_error
def main() -> int:
    _, plan = workload.worker_args()

    # torchrun exports RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    workload.run_plan(plan, lambda case: prepare(case, device, local_rank), rank=dist.get_rank(),
                      local_rank=local_rank, world_size=dist.get_world_size(), device=device)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
