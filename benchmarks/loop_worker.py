"""The benchmark workload through parallelx's training loop, with its options.

    python -m parallelx launch ddp -n 2 -- -m benchmarks.loop_worker --plan plan.json --backend ddp --accumulate 4

Unlike ``px_worker.py`` (the bare step, compared with the plain scripts), this
runs the loop a training script writes with the loop options::

    for x, y in backend.batches(loader):
        with backend.autocast():
            loss = criterion(model(x), y)
        backend.backward(loss)
        backend.step(optimizer)

so that ``--accumulate`` really keeps the gradients local inside a window
and ``--grad-compression`` really puts them on the wire in low precision.
The options are parallelx's own command-line flags (``parallelx.add_arguments``).

A case's ``warmup`` micro-batches (fewer than a window) run first as one
short window, which ends in a full all-reduce and optimizer step (DDP's
first-iteration set-up happens there); then ``steps`` micro-batches, a whole number of windows, are timed
window by window.  The result file's ``step_times_s`` holds each window's
time divided by its micro-batches, so that images/s is processes x batch /
step time for every configuration; ``window_times_s`` holds the windows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

import parallelx
from benchmarks import workload
from parallelx.cli import exit_on_error


def parse_args() -> tuple[argparse.Namespace, workload.Plan]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True, help="plan file written by benchmarks.loops (--keep-work keeps them)")
    parallelx.add_arguments(parser, default="auto")
    try:  # the deepspeed launcher's --local_rank=N; DeepSpeed's own options declare it when it is installed
        parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    except argparse.ArgumentError:
        pass
    args = parser.parse_args()
    return args, workload.Plan.load(args.plan)


def measure(backend: parallelx.Backend, plan: workload.Plan, case: workload.Case) -> dict[str, object]:
    """One case through the loop; this rank's report."""
    k = backend.options.accumulate
    if case.steps % k:
        raise workload.BenchError(f"{case.id}: {case.steps} timed micro-batches are not a whole number of "
                                  f"windows of {k}")
    workload.apply_threads(plan, case, local_rank=backend.local_rank)
    base = workload.build_model(case)
    model, optimizer = backend.setup(base, workload.make_optimizer(base, case))
    pool = workload.synthetic_batches(case, backend.rank, backend.device)
    workload.seed_steps(case, backend.rank)

    def train(micro_batches: int, windows: list[float]) -> torch.Tensor | None:
        loss = None
        loader = [pool[i % len(pool)] for i in range(micro_batches)]
        start = time.perf_counter()
        for x, y in backend.batches(loader):
            with backend.autocast():
                loss = nn.functional.cross_entropy(model(x), y)
            backend.backward(loss)
            if backend.step(optimizer) is not None:
                workload.synchronize(backend.device)
                now = time.perf_counter()
                windows.append(now - start)
                start = now
        return loss

    # A pass shorter than a window is one short window: the warm-up ends in a full synchronising step.
    train(case.warmup, [])
    windows: list[float] = []
    loss = train(case.steps, windows)
    report = {
        "impl": plan.impl, "case": asdict(case), "case_id": case.id, "rank": backend.rank,
        "world_size": backend.world_size, "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cores": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "device": str(backend.device), "options": asdict(backend.options), "accumulate": k,
        "window_times_s": windows, "step_times_s": [w / k for w in windows],
        "peak_rss_mib": workload.peak_rss_mib(),
        "peak_gpu_mib": torch.cuda.max_memory_allocated(backend.device) / 2**20
        if backend.device.type == "cuda" else None,
        "final_loss": float(loss.detach().float().cpu()) if loss is not None else None,
    }
    del model, optimizer, base, pool
    workload.release(backend.device)
    return report


@exit_on_error
@workload.exit_on_bench_error
def main() -> int:
    args, plan = parse_args()
    # DeepSpeed's config wants the per-process micro-batch; only its bookkeeping reads it.
    args.batch_size = plan.cases[0].batch
    with parallelx.from_args(args).init() as backend:  # shut down even when a case raises
        workload.check_world_size(plan, backend.world_size)
        out = Path(plan.out)
        out.mkdir(parents=True, exist_ok=True)
        for case in plan.cases:
            report = measure(backend, plan, case)
            workload.result_path(out, plan.impl, case, backend.rank).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
