"""The benchmark workload through parallelx: one script for every backend.

    python -m parallelx launch horovod -n 2 -- -m benchmarks.px_worker --plan plan.json

``benchmarks.run`` starts it the same way, under the backend's own launcher,
with a plan of several cases.  The training step is the one parallelx
documents: ``backend.backward(loss); optimizer.step(); optimizer.zero_grad()``.
Compare with ``raw_ddp.py``, ``raw_horovod.py`` and ``raw_deepspeed.py``.
"""

from __future__ import annotations

import argparse
import sys

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
    """The initialised parallelx backend for the benchmark's processes, with
    the options a training script's ``--batch-size`` would give it (DeepSpeed's
    config wants the per-process batch; only its bookkeeping reads it, the data
    is ours, so the first case's value serves all)."""
    options = parallelx.backend_class(name).options_from_args(argparse.Namespace(batch_size=plan.cases[0].batch))
    return parallelx.get_backend(name, **options).init()


@exit_on_error
@workload.exit_on_bench_error
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", required=True, choices=[b for b in parallelx.available_backends() if b != "auto"])
    args, plan = workload.worker_args(parser)

    with make_backend(args.backend, plan) as backend:  # shut down even when a case raises
        workload.run_plan(plan, lambda case: prepare(backend, case), rank=backend.rank,
                          local_rank=backend.local_rank, world_size=backend.world_size, device=backend.device,
                          state_dict=backend.model_state_dict)
    return 0


if __name__ == "__main__":
    sys.exit(main())
