"""The benchmark workload through parallelx: one script for every backend.

    python -m parallelx launch ddp -n 2 -- -m benchmarks.px_worker --plan P --backend ddp [--loop --accumulate 4]

By default it times the step parallelx documents (``backend.backward(loss);
optimizer.step(); optimizer.zero_grad()``) against ``benchmarks.plain``'s.
``--loop`` (``benchmarks.loops``) runs the loop a script writes with the loop
options, ``backend.batches`` / ``autocast`` / ``backward`` / ``step``, so that
``--accumulate`` really keeps gradients local inside a window and
``--grad-compression`` really puts them on the wire in low precision; its
``step_times_s`` are window times over their micro-batches, so that images/s
is processes x batch / step time in every configuration.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

import torch
from torch import nn

import parallelx
from benchmarks import workload
from parallelx.cli import exit_on_error


def prepare(backend: parallelx.Backend, case: workload.Case) -> tuple[workload.Step, nn.Module]:
    """The model and optimizer through ``backend.setup``, as a training step (and the wrapped model)."""
    base = workload.build_model(case)
    model, optimizer = backend.setup(base, workload.make_optimizer(base, case))

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.cross_entropy(model(x), y)
        backend.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return train_step, model


def make_backend(name: str, plan: workload.Plan) -> parallelx.Backend:
    """The initialised backend, with the options a script's ``--batch-size`` would give it
    (DeepSpeed's config wants the per-process batch; only its bookkeeping reads it)."""
    options = parallelx.backend_class(name).options_from_args(argparse.Namespace(batch_size=plan.cases[0].batch))
    return parallelx.get_backend(name, **options).init()


def measure_loop(backend: parallelx.Backend, plan: workload.Plan, case: workload.Case) -> dict[str, object]:
    """One case through the loop; this rank's report."""
    k = backend.options.accumulate
    if case.steps % k:
        raise workload.BenchError(f"{case.id}: {case.steps} timed micro-batches are not whole windows of {k}")
    workload.apply_threads(plan, case, local_rank=backend.local_rank)
    base = workload.build_model(case)
    model, optimizer = backend.setup(base, workload.make_optimizer(base, case))
    pool = workload.synthetic_batches(case, backend.rank, backend.device)
    workload.seed_steps(case, backend.rank)

    def train(micro_batches: int, windows: list[float]) -> torch.Tensor | None:
        loss, start = None, time.perf_counter()
        for x, y in backend.batches([pool[i % len(pool)] for i in range(micro_batches)]):
            with backend.autocast():
                loss = nn.functional.cross_entropy(model(x), y)
            backend.backward(loss)
            if backend.step(optimizer) is not None:
                workload.synchronize(backend.device)
                windows.append(time.perf_counter() - start)
                start = time.perf_counter()
        return loss

    train(case.warmup, [])  # shorter than a window: one short window, ending in a full synchronising step
    windows: list[float] = []
    loss = train(case.steps, windows)
    report = workload.rank_report(
        plan,
        case,
        backend.rank,
        backend.world_size,
        backend.device,
        loss,
        options=asdict(backend.options),
        accumulate=k,
        window_times_s=windows,
        step_times_s=[w / k for w in windows],
    )
    return report


@exit_on_error
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parallelx.add_arguments(parser)
    parser.add_argument("--loop", action="store_true", help="time parallelx's loop (batches/step) with its options")
    args, plan = workload.worker_args(parser)
    args.batch_size = plan.cases[0].batch  # DeepSpeed's config wants the per-process micro-batch
    with parallelx.from_args(args).init() as backend:  # shut down even when a case raises
        if not args.loop:
            workload.run_plan(
                plan,
                lambda case: prepare(backend, case),
                rank=backend.rank,
                local_rank=backend.local_rank,
                world_size=backend.world_size,
                device=backend.device,
                state_dict=backend.model_state_dict,
            )
            return 0
        workload.check_world_size(plan, backend.world_size)
        for case in plan.cases:
            path = workload.result_path(plan.out, plan.impl, case, backend.rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(measure_loop(backend, plan, case)))
            workload.release(backend.device)  # the case's model and optimizer went with measure_loop's frame
    return 0


if __name__ == "__main__":
    sys.exit(main())
