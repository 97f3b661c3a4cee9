"""The benchmark workload in HuggingFace Accelerate, written as Accelerate's
quick tour shows it (no parallelx): the peer most users would pick instead.

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no -m benchmarks.raw_accelerate --out /tmp/bench

On a machine without GPUs also export ``ACCELERATE_USE_CPU=1``: Accelerate
1.x's ``--cpu --num_processes 2`` starts a single process unless it is given
an MPI hostfile, and ``--multi_gpu`` alone starts N processes that each train
alone (world size 1).  ``benchmarks.run`` does this for you.
"""

from __future__ import annotations

import sys

from torch import nn

from benchmarks import workload


@workload.exit_on_bench_error
def main() -> int:
    _, plan = workload.worker_args("accelerate")
    from accelerate import Accelerator

    accelerator = Accelerator()
    device = accelerator.device
    rank = accelerator.process_index
    workload.check_world_size(plan, accelerator.num_processes)

    for case in plan.cases:
        # After Accelerator(), which may set torch's thread count itself on the CPU.
        workload.apply_threads(plan, case, local_rank=accelerator.local_process_index)
        model = workload.build_model(case)
        optimizer = workload.make_optimizer(model, case)
        model, optimizer = accelerator.prepare(model, optimizer)
        batches = workload.synthetic_batches(case, rank, device)
        workload.seed_steps(case, rank)
        times: list[float] = []
        for x, y in workload.timed_steps(case, batches, device, times):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
        weights = accelerator.unwrap_model(model).state_dict() if case.save_weights else None
        workload.record(plan, case, rank=rank, world_size=accelerator.num_processes, device=device, times=times,
                        loss=loss, weights=weights, extra={"distributed_type": str(accelerator.distributed_type)})
        del model, optimizer, batches, weights
        accelerator.free_memory()
        workload.release(device)
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
