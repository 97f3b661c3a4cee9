"""The benchmark workload in each framework's own documented form, without parallelx.

    python -m parallelx launch ddp -n 2 -- -m benchmarks.plain --framework ddp --plan plan.json

Per framework, ``init`` is its start-up and ``prepare`` its set-up of model and
optimizer as a training step, as its guide writes them (benchmarks/README.md
names the guides and the two deliberate departures: Horovod's learning rate
is not scaled by the world size, DeepSpeed's default clipping is off, so that
every implementation does DDP's math).  Model, data, seeds and timing come
from ``benchmarks.workload``; ``same_process`` calls the ``prepare`` functions
in processes that parallelx has initialised.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from benchmarks import workload
from parallelx.cli import exit_on_error


@dataclass
class World:
    """Where this process stands, as its framework's start-up says."""

    rank: int
    local_rank: int
    size: int
    device: torch.device
    finish: Callable[[], Any] = lambda: None


def _device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_ddp() -> World:
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])  # torchrun exports it, with RANK, WORLD_SIZE, MASTER_ADDR/PORT
    device = _device(local_rank)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return World(dist.get_rank(), local_rank, dist.get_world_size(), device, dist.destroy_process_group)


def prepare_ddp(case: workload.Case, world: World) -> tuple[workload.Step, nn.Module]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = workload.build_model(case).to(world.device)
    ddp_model = DDP(model, device_ids=[world.local_rank] if world.device.type == "cuda" else None)
    return workload.torch_step(ddp_model, workload.make_optimizer(ddp_model, case)), model


def init_horovod() -> World:
    import horovod.torch as hvd

    hvd.init()
    return World(hvd.rank(), hvd.local_rank(), hvd.size(), _device(hvd.local_rank()), hvd.shutdown)


def prepare_horovod(case: workload.Case, world: World) -> tuple[workload.Step, nn.Module]:
    import horovod.torch as hvd

    model = workload.build_model(case).to(world.device)
    optimizer = workload.make_optimizer(model, case)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), op=hvd.Average)
    return workload.torch_step(model, optimizer), model


def init_deepspeed() -> World:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    deepspeed.init_distributed()  # without a GPU DeepSpeed picks its CPU accelerator (Gloo) by itself
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # Where the engine puts the model: the accelerator's device of this local rank.
    device = torch.device(get_accelerator().device_name(local_rank))
    return World(dist.get_rank(), local_rank, dist.get_world_size(), device, dist.destroy_process_group)


def prepare_deepspeed(case: workload.Case, world: World) -> tuple[workload.Step, nn.Module]:
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": case.batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 0},
        # DeepSpeed clips at norm 1.0 by default since 0.19.3 (the guide predates it): off, as DDP's math.
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }  # no progress lines inside the timed loop
    model = workload.build_model(case)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=workload.make_optimizer(model, case), config=config)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss

    return train_step, engine.module


Prepare = Callable[[workload.Case, World], tuple[workload.Step, nn.Module]]
FRAMEWORKS: dict[str, tuple[Callable[[], World], Prepare]] = {
    "ddp": (init_ddp, prepare_ddp),
    "horovod": (init_horovod, prepare_horovod),
    "deepspeed": (init_deepspeed, prepare_deepspeed),
}


@exit_on_error
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", required=True, choices=sorted(FRAMEWORKS))
    args, plan = workload.worker_args(parser)
    init, prepare = FRAMEWORKS[args.framework]
    world = init()
    workload.run_plan(
        plan,
        lambda case: prepare(case, world),
        rank=world.rank,
        local_rank=world.local_rank,
        world_size=world.size,
        device=world.device,
    )
    world.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
