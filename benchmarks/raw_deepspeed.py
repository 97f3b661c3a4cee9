"""The benchmark workload in plain DeepSpeed, written as DeepSpeed's
"Getting Started" guide shows it (no parallelx).

``benchmarks.run`` starts it under the ``deepspeed`` backend's launcher.

Model, optimizer, synthetic data, seeds and timing come from
``benchmarks.workload`` so that the work equals ``px_worker --backend deepspeed``:
ZeRO stage 0, fp32, the client's ``torch.optim.SGD`` handed to
``deepspeed.initialize``.  Without a GPU DeepSpeed picks its CPU accelerator
(Gloo) by itself.  One deliberate difference from the guide: gradient
clipping is off, so that the math is that of DDP and of parallelx.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

from benchmarks import workload


def prepare(case: workload.Case, args: argparse.Namespace | None) -> tuple[workload.Step, nn.Module]:
    """The engine from ``deepspeed.initialize``, as a training step (and the
    engine's module).  ``deepspeed.init_distributed()`` must have run."""
    import deepspeed

    ds_config = {
        "train_micro_batch_size_per_gpu": case.batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 0},
        # DeepSpeed clips gradients at norm 1.0 by default since 0.19.3 (the
        # guide's config predates that): off, so that the math is DDP's.
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,  # no progress lines inside the timed loop
    }
    model = workload.build_model(case)
    optimizer = workload.make_optimizer(model, case)
    model_engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model, optimizer=optimizer,
                                                         config=ds_config)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.cross_entropy(model_engine(x), y)
        model_engine.backward(loss)
        model_engine.step()
        return loss

    return train_step, model_engine.module


@workload.exit_on_bench_error
def main() -> int:
    import deepspeed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser = deepspeed.add_config_arguments(parser)
    args, plan = workload.worker_args(parser)

    deepspeed.init_distributed()
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    # Where the engine puts the model: the accelerator's device of this local rank.
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(get_accelerator().device_name(local_rank))
    workload.run_plan(plan, lambda case: prepare(case, args), rank=dist.get_rank(), local_rank=local_rank,
                      world_size=dist.get_world_size(), device=device)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
