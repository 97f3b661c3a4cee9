"""``--precision bf16-compute`` on ddp and fsdp at 2 processes, beside ``32`` (the floor of summation
order) and ``bf16-mixed`` (``--precisions``): the GPT (``gpt.py``: tied embedding, AdamW in groups) trained a few
steps on the global batch split over the ranks; rank 0 saves each run's final weights as
``<case>-<precision>.pt``, and each rank writes ``rank<r>.json`` with the dtypes a forward saw (the
gathered weights of a block, the loss) and those the optimizer steps.

    torchrun --nproc-per-node 2 tests/support/compute_dtype_worker.py --backend ddp --out DIR [--precisions 32,bf16-compute]

``tests/launcher/test_compute_dtype_launch.py`` compares the weights with one process's (``reference``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from gpt import GPT, Config, adamw_groups, tokens

import parallelx
from parallelx.strategy import unwrap

#: No biases: an attention's key bias has no gradient but rounding, which AdamW makes full steps of.
CFG = Config(bias=False)
#: Optimizer steps; each rank's micro-batch is half of the global batch of ``2 * B`` sequences.
STEPS, B = 4, 4
PRECISIONS = ("32", "bf16-mixed", "bf16-compute")
#: launcher backend -> the cases it runs: (name, backend, options)
CASES: dict[str, list[tuple[str, str, dict[str, Any]]]] = {"ddp": [("ddp", "ddp", {}), ("fsdp", "fsdp", {})]}


def batch(rank: int, world: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s share of step ``step``'s global batch (the whole of it at ``world`` 1)."""
    x, y = tokens(0, step, 2 * B, CFG)
    share = 2 * B // world
    return x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]


def train(backend: parallelx.Backend) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The weights after :data:`STEPS` steps, and the dtypes seen."""
    torch.manual_seed(0)
    model = GPT(CFG)
    model, optimizer = backend.setup(model, adamw_groups(model))
    seen: dict[str, Any] = {}
    block = unwrap(model).transformer.h[0].mlp[0]  # a Linear inside fsdp's first unit

    def look(module: torch.nn.Module, args: Any) -> None:
        seen.setdefault("weight_in_forward", str(module.weight.dtype))

    block.register_forward_pre_hook(look)
    for step in range(STEPS):
        x, y = batch(backend.rank, backend.world_size, step)
        with backend.autocast():
            _, loss = model(x.to(backend.device), y.to(backend.device))
        seen.setdefault("loss", str(loss.dtype))
        backend.backward(loss)
        backend.step(optimizer)
    seen["stepped"] = sorted({str(p.dtype) for g in optimizer.param_groups for p in g["params"]})
    return backend.model_state_dict(model), seen


def reference(precision: str) -> dict[str, torch.Tensor]:
    """One process (``single``) on the global batch with ``precision``."""
    with parallelx.get_backend("single", precision=precision, device="cpu").init() as backend:
        return train(backend)[0]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", required=True, choices=sorted(CASES))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    args = p.parse_args()
    torch.set_num_threads(1)
    report: dict[str, Any] = {}
    owner = None
    for name, kind, options in CASES[args.backend]:
        for precision in args.precisions.split(","):
            backend = parallelx.get_backend(kind, precision=precision, device="cpu", **options).init()
            owner = owner or backend  # the first backend made the process group: it is shut down last
            weights, report[f"{name}-{precision}"] = train(backend)
            if backend.rank == 0:
                torch.save(weights, args.out / f"{name}-{precision}.pt")
            if backend is not owner:
                backend.shutdown()
    assert owner is not None
    (args.out / f"rank{owner.rank}.json").write_text(json.dumps(report, indent=1))
    owner.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
