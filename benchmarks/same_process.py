"""The plain training step and parallelx's, side by side in the same processes.

    python -m parallelx launch deepspeed -n 2 -- -m benchmarks.same_process --backend deepspeed --plan plan.json

Separate launches differ by 5-20 % from one to the next on a shared machine,
far more than the 2 % in question.  One launch here builds both steps on two
copies of the same initial model and alternates blocks of timed steps (plain
then parallelx, parallelx then plain, ...), so that both meet the same
process, threads and moment; on the same batches their final weights must
agree too.  The process group is parallelx's; the frameworks' own
initialisation finds it done.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

import parallelx
import parallelx.parts.loop
from benchmarks import plain, px_worker, workload
from parallelx.cli import exit_on_error


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float().cpu() - b[k].float().cpu()).abs().max()) for k in b)


def measure(name: str, blocks_n: int, plan: workload.Plan, backend: parallelx.Backend, precision: str) -> None:
    """Every case of ``plan``: ``blocks_n`` blocks of each step, alternating; one result file per rank."""
    workload.check_world_size(plan, backend.world_size)
    # --precision as parallelx defines it, around both implementations' whole step.
    dtype = parallelx.parts.loop.LoopOptions(precision=precision).autocast_dtype
    world = plain.World(backend.rank, backend.local_rank, backend.world_size, backend.device)
    for case in plan.cases:
        workload.apply_threads(plan, case, local_rank=backend.local_rank)
        # Both builds start from the same seeded weights (build_model seeds).
        steps = {"plain": plain.FRAMEWORKS[name][1](case, world), "parallelx": px_worker.prepare(backend, case)}
        batches = workload.synthetic_batches(case, backend.rank, backend.device)
        workload.seed_steps(case, backend.rank)
        blocks: dict[str, list[list[float]]] = {"plain": [], "parallelx": []}
        for b in range(blocks_n):
            for impl in ("plain", "parallelx") if b % 2 == 0 else ("parallelx", "plain"):
                # The warm-up of each block lets caches and allocator settle after the other model ran.
                times: list[float] = []
                for x, y in workload.timed_steps(
                    case, batches, backend.device, times, first=len(blocks[impl]) * (case.warmup + case.steps)
                ):
                    with contextlib.nullcontext() if dtype is None else torch.autocast(backend.device.type, dtype):
                        loss = steps[impl][0](x, y)
                blocks[impl].append(times)
        plain_w = backend.unwrap(steps["plain"][1]).state_dict()
        px_w = backend.model_state_dict(steps["parallelx"][1])
        start_w = workload.build_model(case).state_dict()  # the seeded initial weights of both
        Path(plan.out).mkdir(parents=True, exist_ok=True)
        # max_abs_update: the training moved the weights (equal weights that never moved would prove nothing).
        report = {
            "impl": plan.impl,
            "case_id": case.id,
            "rank": backend.rank,
            "world_size": backend.world_size,
            "threads": torch.get_num_threads(),
            "device": str(backend.device),
            "blocks": blocks,
            "max_abs_weight_diff": max_diff(plain_w, px_w),
            "max_abs_update": max_diff(px_w, start_w),
            "final_loss": float(loss.detach().float().cpu()),
        }
        workload.result_path(plan.out, plan.impl, case, backend.rank).write_text(json.dumps(report))
        del steps, batches, plain_w, px_w
        workload.release(backend.device)


@exit_on_error
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", required=True, choices=sorted(plain.FRAMEWORKS))
    parser.add_argument(
        "--blocks", type=parallelx.cli.positive_int, default=10, help="blocks of each implementation, alternating"
    )
    parser.add_argument(
        "--precision",
        choices=parallelx.parts.loop.PRECISIONS,
        default="32",
        help="autocast both implementations' steps to this precision",
    )
    args, plan = workload.worker_args(parser)
    with px_worker.make_backend(args.backend, plan) as backend:  # shut down even when a case raises
        measure(args.backend, args.blocks, plan, backend, args.precision)
    return 0


if __name__ == "__main__":
    sys.exit(main())
