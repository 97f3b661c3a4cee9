"""The plain training step and parallelx's, side by side in the same processes.

    torchrun --nproc-per-node 2 -m benchmarks.same_process --backend ddp --out /tmp/bench
    horovodrun -np 2 -H localhost:2 --gloo python -m benchmarks.same_process --backend horovod --out /tmp/bench
    deepspeed --num_gpus 2 --module benchmarks.same_process --backend deepspeed --out /tmp/bench

Separate launches of the plain script and of parallelx differ by 5-20 % from
one launch to the next on a shared machine (where the scheduler puts the
threads, what else runs), far more than the 2 % in question.  Here one
launch builds both: the plain script's own ``prepare`` (``raw_ddp``,
``raw_horovod``, ``raw_deepspeed``) and ``px_worker.prepare`` through
parallelx, on two copies of the same initial model.  It then alternates
blocks of timed steps, plain then parallelx, parallelx then plain, and so on,
so that both meet the same process, the same threads and the same moment of
the machine.  Both models see the same batches in the same order, so their
final weights must also agree.

The process group comes from parallelx's ``backend.init()``; the plain
frameworks' own initialisation (``hvd.init()``, ``deepspeed.init_distributed()``)
finds it already done.  This measures the per-step path only: set-up and
launch costs are in the separate-launch comparison of ``benchmarks.run``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import parallelx
from benchmarks import px_worker, workload
from parallelx.cli import exit_on_error

BACKENDS = ("ddp", "horovod", "deepspeed")


def plain_prepare(name: str, case: workload.Case, backend: parallelx.Backend) -> tuple[workload.Step, torch.nn.Module]:
    """The plain script's training step for ``case``, in processes that
    ``backend`` has already initialised."""
    if name == "ddp":
        from benchmarks import raw_ddp

        return raw_ddp.prepare(case, backend.device, backend.local_rank)
    if name == "horovod":
        from benchmarks import raw_horovod

        return raw_horovod.prepare(case, backend.device)
    from benchmarks import raw_deepspeed

    return raw_deepspeed.prepare(case, None)


def time_block(step: workload.Step, batches: list[tuple[torch.Tensor, torch.Tensor]], first: int, warmup: int,
               steps: int, device: torch.device) -> tuple[list[float], torch.Tensor]:
    """``warmup`` untimed then ``steps`` timed steps, on the batches from
    index ``first`` on; returns the step times and the last loss."""
    times = []
    for i in range(warmup + steps):
        x, y = batches[(first + i) % len(batches)]
        start = time.perf_counter()
        loss = step(x, y)
        workload.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times, loss


@exit_on_error
@workload.exit_on_bench_error
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", required=True, choices=BACKENDS)
    parser.add_argument("--blocks", type=int, default=10, help="blocks of each implementation, alternating")
    args, plan = workload.worker_args(lambda a: f"same-{a.backend}", parser)
    if args.blocks < 1:
        raise workload.BenchError(f"--blocks must be >= 1, got {args.blocks}")

    backend = px_worker.make_backend(args.backend, plan)
    workload.check_world_size(plan, backend.world_size)
    for case in plan.cases:
        workload.apply_threads(plan, case, local_rank=backend.local_rank)
        # Both builds start from the same seeded weights (build_model seeds).
        steps = {"plain": plain_prepare(args.backend, case, backend), "parallelx": px_worker.prepare(backend, case)}
        batches = workload.synthetic_batches(case, backend.rank, backend.device)
        workload.seed_steps(case, backend.rank)
        blocks: dict[str, list[list[float]]] = {"plain": [], "parallelx": []}
        position = {"plain": 0, "parallelx": 0}
        for b in range(args.blocks):
            for name in ("plain", "parallelx") if b % 2 == 0 else ("parallelx", "plain"):
                # The warm-up of each block lets caches and allocator settle after the other model ran.
                times, loss = time_block(steps[name][0], batches, position[name], case.warmup, case.steps,
                                         backend.device)
                position[name] += case.warmup + case.steps
                blocks[name].append(times)
        plain_w = backend.unwrap(steps["plain"][1]).state_dict()
        px_w = backend.model_state_dict(steps["parallelx"][1])
        diff = max(float((plain_w[k].float().cpu() - px_w[k].float().cpu()).abs().max()) for k in px_w)
        out = Path(plan.out)
        out.mkdir(parents=True, exist_ok=True)
        report = {"impl": plan.impl, "case_id": case.id, "rank": backend.rank, "world_size": backend.world_size,
                  "threads": torch.get_num_threads(), "device": str(backend.device), "blocks": blocks,
                  "block_medians_s": {k: [statistics.median(t) for t in v] for k, v in blocks.items()},
                  "max_abs_weight_diff": diff, "final_loss": float(loss.detach().float().cpu())}
        workload.result_path(out, plan.impl, case, backend.rank).write_text(json.dumps(report))
        del steps, batches, plain_w, px_w
        workload.release(backend.device)
    backend.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
