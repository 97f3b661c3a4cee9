"""A training script for an elastic run (``backend.run_elastic``), started by
tests/system/test_elastic.py under ``horovodrun --min-np 1 --max-np 2
--host-discovery-script``.

``train()`` is written the elastic way: each call builds the model, the
optimizer and the sampler for the world it runs in, resumes from the latest
training-state checkpoint on disk, and saves one (then ``elastic_commit``)
every ``--commit-every`` optimizer steps.  Every rank appends one JSON line per
event to ``<log-dir>/<pid>.jsonl``: the samples of each step, each commit,
each (re)start of ``train()`` and the checkpoint it resumed from.  With
``--kill-step N`` rank 1 of the first two-rank world SIGKILLs itself right
after step N; ``--step-sleep`` slows the steps down for a kill from outside.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import parallelx


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--log-dir", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--commit-every", type=int, default=3)
    parser.add_argument("--kill-step", type=int, default=0)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    args = parser.parse_args()

    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, 4, generator=g)
    dataset = TensorDataset(x, x.sum(1, keepdim=True), torch.arange(args.samples))
    log_file = open(args.log_dir / f"{os.getpid()}.jsonl", "a", buffering=1)

    backend = parallelx.get_backend("horovod")
    attempts = 0

    def record(event: str, **fields: Any) -> None:
        fields.update(
            event=event,
            pid=os.getpid(),
            attempt=attempts,
            rank=backend.rank,
            world=backend.world_size,
            time=time.time(),
        )
        log_file.write(json.dumps(fields) + "\n")

    def train() -> dict[str, int]:
        nonlocal attempts
        attempts += 1
        torch.manual_seed(0)
        model = backend.wrap_model(nn.Linear(4, 1))
        optimizer = backend.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        sampler = backend.make_sampler(dataset, shuffle=True, seed=1)
        counters = {"step": 0}
        path = parallelx.latest_checkpoint(args.run_dir)
        if path is not None:
            counters = parallelx.load_training_state(backend, path, model=model, optimizer=optimizer, sampler=sampler)[
                "counters"
            ]
        record("start", from_step=counters["step"], checkpoint=None if path is None else path.name)
        loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
        # The sampler's epoch is the truth: a checkpoint saved after an epoch's
        # last step already points at the next epoch.
        while sampler.epoch < args.epochs:
            epoch = sampler.epoch
            for xb, yb, idx in backend.batches(loader):
                loss = nn.functional.mse_loss(model(xb), yb)
                backend.backward(loss)
                backend.step(optimizer)
                counters["step"] += 1
                record("step", step=counters["step"], epoch=epoch, idx=idx.tolist())
                if (
                    args.kill_step
                    and attempts == 1
                    and backend.world_size == 2
                    and backend.rank == 1
                    and counters["step"] == args.kill_step
                ):
                    record("kill", step=counters["step"])
                    os.kill(os.getpid(), signal.SIGKILL)
                if counters["step"] % args.commit_every == 0:
                    parallelx.save_training_state(
                        backend,
                        args.run_dir,
                        step=counters["step"],
                        model=model,
                        optimizer=optimizer,
                        sampler=sampler,
                        counters=counters,
                    )
                    record("commit", step=counters["step"])
                    backend.elastic_commit()
                time.sleep(args.step_sleep)
        parallelx.save_training_state(
            backend,
            args.run_dir,
            step=counters["step"],
            model=model,
            optimizer=optimizer,
            sampler=sampler,
            counters=counters,
        )
        record("done", step=counters["step"])
        return counters

    with backend:
        result = backend.run_elastic(train)
    log_file.close()
    print(f"elastic_worker: finished at step {result['step']} after {attempts} attempt(s)", flush=True)


if __name__ == "__main__":
    main()
