"""The benchmark workload in plain Horovod, written as Horovod's PyTorch
guide and its ``pytorch_mnist.py`` example show it (no parallelx).

``benchmarks.run`` starts it under the ``horovod`` backend's launcher (horovodrun).

Model, optimizer, the guide's training step, synthetic data, seeds and
timing come from ``benchmarks.workload`` so that the work equals
``px_worker --backend horovod``.
One deliberate difference from the guide: the learning rate is *not* scaled
by ``hvd.size()``, so that the math is that of DDP and of parallelx.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from benchmarks import workload


def prepare(case: workload.Case, device: torch.device) -> tuple[workload.Step, nn.Module]:
    """Rank 0's weights and optimizer state broadcast, the optimizer wrapped
    in ``hvd.DistributedOptimizer``: a training step (and the model).
    ``hvd.init()`` must have run."""
    import horovod.torch as hvd

    model = workload.build_model(case).to(device)
    optimizer = workload.make_optimizer(model, case)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), op=hvd.Average)
    return workload.torch_step(model, optimizer), model


@workload.exit_on_bench_error
def main() -> int:
    _, plan = workload.worker_args()
    import horovod.torch as hvd

    hvd.init()
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())
        device = torch.device("cuda", hvd.local_rank())
    else:
        device = torch.device("cpu")

    # The guide limits each worker's CPU threads; the plan says how many (run_plan sets them).
    workload.run_plan(plan, lambda case: prepare(case, device), rank=hvd.rank(), local_rank=hvd.local_rank(),
                      world_size=hvd.size(), device=device)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
