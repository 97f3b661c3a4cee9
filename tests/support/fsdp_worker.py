"""fsdp's own checks in one launch: which modules ``shard=`` makes units, the
device mesh, and sharded training-state checkpoints.

    torchrun --nproc-per-node 2 tests/support/fsdp_worker.py --out DIR              # save (and resume) sharded
    torchrun --nproc-per-node 1 tests/support/fsdp_worker.py --out DIR2 --load-from DIR   # another world size

Saving: SGD with momentum and AdamW, 3 steps, a sharded checkpoint (and a
portable file of the same state), 2 more steps (A); then fresh objects load
the sharded checkpoint and train 2 steps (B).  Loading (``--load-from``): the
newest sharded checkpoint of each optimizer, written at another world size,
cut into this world's shards, then 2 steps (C).  Rank 0 writes ``DIR/result-<optim>.pt``
and ``DIR/units.json`` for ``tests/launcher/test_fsdp.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from trainstate_worker import Run

import parallelx

OPTIMIZERS = ("sgd", "adamw")


def unit_report(backend: parallelx.Backend) -> dict:
    """Which submodules each ``shard=`` choice shards on its own (the root always is)."""

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(8, 64), nn.ReLU(), nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 2)), nn.BatchNorm1d(2)
        )

    out = {}
    for label, options in (
        ("auto", {}),
        ("types", {"shard": [nn.Linear]}),
        ("callable", {"shard": lambda m: isinstance(m, nn.Sequential)}),
    ):
        backend.strategy.shard = options.get("shard")  # type: ignore[attr-defined]  # read at each wrap_model
        wrapped = backend.wrap_model(model())
        out[label] = sorted(n or "<root>" for n, m in wrapped.named_modules() if isinstance(m, FSDPModule))
        out["mesh"] = [backend.strategy.mesh.device_type, list(backend.strategy.mesh.shape)]  # type: ignore[attr-defined]
        out["dtensors"] = all(type(p).__name__ == "DTensor" for p in wrapped.parameters())
        out["local_rows"] = [p.to_local().shape[0] for p in wrapped.parameters()][:2]
    backend.strategy.shard = None  # type: ignore[attr-defined]
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    parallelx.add_arguments(p)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--load-from", type=Path, default=None)
    args = p.parse_args()
    backend = parallelx.get_backend("fsdp", sharded_checkpoints=True)
    with backend:
        if args.load_from is None:
            units = unit_report(backend)
            if backend.is_main():
                (args.out / "units.json").write_text(json.dumps(units))
        for optim in OPTIMIZERS:
            result: dict = {"world_size": backend.world_size}
            if args.load_from is None:
                a = Run(backend, optim, dropout=0.0, noise=False)
                a.train(3)
                path = a.save(args.out / optim)
                backend.save(
                    {"model": a.model, "optimizer": backend.named_optimizer_state(a.model, a.optimizer)},
                    args.out / f"portable-{optim}.pt",
                )
                a.train(2)
                result.update(A=a.weights(), path=str(path))
            else:
                path = parallelx.latest_checkpoint(args.load_from / optim)
            b = Run(backend, optim, init_seed=99, dropout=0.0, noise=False)
            info = b.load(path)
            loaded = backend.model_state_dict(b.model)
            named = backend.named_optimizer_state(b.model, b.optimizer)
            b.train(2)
            result.update(
                B=b.weights(),
                loaded=loaded,
                loaded_optimizer=named,
                meta=info["meta"],
                counters=b.counters,
                seen=b.seen,
            )
            if backend.is_main():
                torch.save(result, args.out / f"result-{optim}.pt")
    return 0


if __name__ == "__main__":
    sys.exit(parallelx.exit_on_error(main)())
