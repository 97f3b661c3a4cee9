"""Sharded training-state checkpoints written by one engine and read by another, under real
launchers (tests/launcher/test_zero_shards.py).

    deepspeed --num_gpus 2 tests/support/zero_shards_worker.py --backend deepspeed --zero-sharded-checkpoints \\
        --stages 1 2 3 --out DIR
    torchrun --nproc-per-node 4 tests/support/zero_shards_worker.py --backend fsdp --fsdp-sharded-checkpoints \\
        --load DIR/zero3/run/checkpoints/step-00000003 --out DIR2

Without ``--load`` (each ZeRO stage of ``--stages``, one launch): A trains SAVE_AT steps, saves (each rank
its partitions), trains MORE; B (other initial weights) loads A's checkpoint and trains MORE.  With
``--load``: B continues that checkpoint (another engine's, another world size), then saves its own.
``--async-stages`` (``--asynchronous``: whatever the backend): A's save of those stages is asynchronous, and its shards are written only after
A has trained on (the write held).  Rank 0 writes ``result.pt``: the whole state A saved (gathered, for the comparison only), the state B
loaded, both runs' final weights.
"""

from __future__ import annotations

import argparse
import threading
from pathlib import Path
from typing import Any

import torch
from trainstate_worker import MORE, SAVE_AT, Run
from worker_cases import add_stages, stage_runs

import parallelx
from parallelx.checkpoints import sharded


def held_shard_writes() -> tuple[threading.Event, list[str]]:
    """Every sharded write waits for the returned event (a slow disk), and records the thread it ran on."""
    go, threads = threading.Event(), []
    write = sharded.write

    def slow(*args: Any) -> None:
        threads.append(threading.current_thread().name)
        assert go.wait(120), "the worker never released the write"
        write(*args)

    sharded.write = slow  # type: ignore[assignment]
    return go, threads


def whole(backend: parallelx.Backend, run: Run) -> dict[str, Any]:
    """The run's model and optimizer state, whole (collectives), for comparisons."""
    named = backend.named_optimizer_state(run.model, run.optimizer)
    return {"model": backend.model_state_dict(run.model), "optimizer": named["state"]}


def main() -> int:
    p = argparse.ArgumentParser()
    parallelx.add_arguments(p)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--load", type=Path, default=None, help="continue this checkpoint")
    p.add_argument("--async-stages", type=int, nargs="*", default=(), help="these stages' first save asynchronous")
    p.add_argument("--asynchronous", action="store_true", help="the first save asynchronous (any backend)")
    add_stages(p)
    args, _ = p.parse_known_args()
    for out, options in stage_runs(args):
        backend = parallelx.from_args(args, **options)
        with backend:
            result: dict[str, Any] = {"world_size": backend.world_size}
            if args.load is None:
                a = Run(backend, "adamw", dropout=0.0, noise=False)
                a.train(SAVE_AT)
                result["saved"] = whole(backend, a)
                if args.asynchronous or options.get("zero_stage") in args.async_stages:
                    # In the background, written only once A has trained on: the copies must be what is written.
                    go, result["writer_threads"] = held_shard_writes()
                    path = a.save(out / "run", asynchronous=True)
                    a.train(MORE)
                    go.set()
                    parallelx.wait_for_checkpoint(backend)
                else:
                    path = a.save(out / "run")
                    a.train(MORE)
                result["A"] = a.weights()
            else:
                path = args.load
            b = Run(backend, "adamw", init_seed=99, dropout=0.0, noise=False)
            info = b.load(path)
            result["loaded"] = whole(backend, b)
            result["sharded"] = info["meta"].get("sharded")
            result["counters"] = dict(b.counters)
            b.train(MORE)
            result["B"] = b.weights()
            if args.load is not None:
                result["saved_B"] = whole(backend, b)
                result["path_B"] = str(b.save(out / "run"))
            if backend.is_main():
                out.mkdir(parents=True, exist_ok=True)
                torch.save(result, out / "result.pt")
    return 0


if __name__ == "__main__":
    raise SystemExit(parallelx.exit_on_error(main)())
