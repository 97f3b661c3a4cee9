"""The benchmark workload in HuggingFace Accelerate, written as Accelerate's
quick tour shows it (no parallelx): the peer most users would pick instead.

``benchmarks.run`` starts it with ``benchmarks.launch.ACCELERATE``
(``accelerate launch --multi_gpu --num_processes N``).  Without GPUs the
worker asks for the CPU (``Accelerator(cpu=True)``) and the launch still
says ``--multi_gpu``: Accelerate 1.x's ``--cpu --num_processes 2`` starts a
single process unless it is given an MPI hostfile, and ``--multi_gpu``
alone starts N processes that each train alone (world size 1).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch
from torch import nn

from benchmarks import workload

if TYPE_CHECKING:
    from accelerate import Accelerator


def prepare(case: workload.Case, accelerator: Accelerator) -> tuple[workload.Step, nn.Module]:
    """Model and optimizer through ``accelerator.prepare``, as a training step (and the prepared model)."""
    accelerator.free_memory()  # the previous case's model and optimizer
    model = workload.build_model(case)
    model, optimizer = accelerator.prepare(model, workload.make_optimizer(model, case))
    return workload.torch_step(model, optimizer, accelerator.backward), model


@workload.exit_on_bench_error
def main() -> int:
    _, plan = workload.worker_args()
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    # run_plan sets the threads after Accelerator(), which may set torch's thread count itself on the CPU.
    workload.run_plan(plan, lambda case: prepare(case, accelerator), rank=accelerator.process_index,
                      local_rank=accelerator.local_process_index, world_size=accelerator.num_processes,
                      device=accelerator.device, state_dict=lambda m: accelerator.unwrap_model(m).state_dict())
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
