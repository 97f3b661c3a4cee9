"""Hybrid sharding (HSDP) against ddp, in one launch per run (``tests/launcher/test_hsdp.py``).

    torchrun --nproc-per-node 4 tests/support/hsdp_worker.py --backend fsdp --replicate 2 --out H
    torchrun --nproc-per-node 4 tests/support/hsdp_worker.py --backend ddp --out D
    torchrun --nproc-per-node 2 tests/support/hsdp_worker.py --backend fsdp --replicate 1 --out C --load-from H

For SGD with momentum and AdamW, with the gradients clipped at a norm they always exceed (so
the norm scales every update): 3 steps, a training-state checkpoint (sharded under fsdp) and
a portable copy of the same state, 2 more steps (A), then one step more whose unclipped norm
is reported (the norm the trackers log); under fsdp, fresh objects resume the checkpoint and
train 2 steps (B), and the weights go out through ``parallelx.save_pretrained`` (nothing
gathered; under HSDP the first group writes).  With ``--load-from``: the newest checkpoint of
each optimizer, written on another mesh and world size, cut into this one's shards, then 2
steps (C).  Rank 0 writes ``OUT/result-<optim>.pt`` and ``OUT/mesh.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn
from trainstate_worker import Run, dataset

import parallelx

OPTIMIZERS = ("sgd", "adamw")
CLIP = 0.05  # below every step's norm here: the norm scales each update


def reported_norm(backend: parallelx.Backend, run: Run) -> float:
    """One more step without clipping; the global gradient norm the step reports."""
    backend.set_options(clip_grad_norm=None)
    x, y, _ = dataset()[: 3 * backend.world_size]
    rows = slice(3 * backend.rank, 3 * (backend.rank + 1))
    backend.backward(nn.functional.cross_entropy(run.model(x[rows]), y[rows]))
    result = backend.step(run.optimizer)
    run.optimizer.zero_grad()
    backend.set_options(clip_grad_norm=CLIP)
    assert result is not None
    return float(result.grad_norm)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=("fsdp", "ddp"), required=True)
    p.add_argument("--replicate", type=int, default=None)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--load-from", type=Path, default=None)
    p.add_argument("--local_rank", type=int, default=None)  # under the deepspeed launcher
    args = p.parse_args()
    fsdp = args.backend == "fsdp"
    options = {"sharded_checkpoints": True, "replicate": args.replicate} if fsdp else {}
    backend = parallelx.get_backend(args.backend, **options)
    with backend:
        backend.set_options(clip_grad_norm=CLIP)
        if backend.is_main() and fsdp:
            mesh = backend.strategy.mesh  # type: ignore[attr-defined]
            (args.out / "mesh.json").write_text(json.dumps({"shape": list(mesh.shape), "names": mesh.mesh_dim_names}))
        for optim in OPTIMIZERS:
            result: dict = {"world_size": backend.world_size}
            if args.load_from is None:
                a = Run(backend, optim, dropout=0.0, noise=False)
                a.train(3)
                path = a.save(args.out / optim)
                result["portable"] = {
                    "model": backend.model_state_dict(a.model),
                    "optimizer": backend.named_optimizer_state(a.model, a.optimizer),
                }
                a.train(2)
                result.update(A=a.weights(), path=str(path), rows=[list(p.shape) for p in a.model.parameters()])
                if fsdp:
                    local = [p.to_local().shape[0] for p in a.model.parameters() if hasattr(p, "to_local")]
                    result["local_rows"] = local
                parallelx.save_pretrained(backend, a.model, args.out / f"weights-{optim}")
                result["norm"] = reported_norm(backend, a)
                if fsdp:
                    b = Run(backend, optim, init_seed=99, dropout=0.0, noise=False)
                    b.load(path)
                    b.train(2)
                    result["B"] = b.weights()
            else:
                path = parallelx.latest_checkpoint(args.load_from / optim)
                c = Run(backend, optim, init_seed=99, dropout=0.0, noise=False)
                info = c.load(path)
                result.update(
                    loaded=backend.model_state_dict(c.model),
                    loaded_optimizer=backend.named_optimizer_state(c.model, c.optimizer),
                    meta=info["meta"],
                )
                c.train(2)
                result["C"] = c.weights()
            if backend.is_main():
                torch.save(result, args.out / f"result-{optim}.pt")
    return 0


if __name__ == "__main__":
    sys.exit(parallelx.exit_on_error(main)())
