"""Run under a real launcher (2 processes): the same training with gradients on the wire in
float32 (no compression), float16 and bfloat16 (``--grad-compression``), to measure how far
each backend's rounding of the compressed all-reduce takes the weights from ddp's.

For each wire type the backend's options change (``backend.set_options``), a fresh MLP
(LayerNorm, GELU; 4 layers) is set up from the same seed and trained 5 SGD steps (momentum
0.9) on the same global batches, each rank its half.  The ``-small`` runs scale the loss by
1e-4 and the learning rate by 1e4 (the same update in float32): their gradients fall below
float16's smallest normal number (6.1e-5), where dividing by the world size before the sum
and after it round differently.  Rank 0 writes ``<out>/<run>.pt`` (the whole weights) and
``<out>/report.json`` (per run: the weights' file, or the ``ParallelxError`` the backend
raised).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from worker_cases import add_stages, stage_runs

import parallelx
from parallelx.errors import ParallelxError

#: run -> (wire type, loss scale)
RUNS = {
    "none": ("none", 1.0),
    "fp16": ("fp16", 1.0),
    "bf16": ("bf16", 1.0),
    "none-small": ("none", 1e-4),
    "fp16-small": ("fp16", 1e-4),
}
STEPS, B = 5, 8


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10)
    )


def train(backend: parallelx.Backend, scale: float) -> dict[str, torch.Tensor]:
    net = model()
    net, opt = backend.setup(net, torch.optim.SGD(net.parameters(), lr=0.1 / scale, momentum=0.9))
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(2 * B, 32, generator=g)
        y = torch.randint(0, 10, (2 * B,), generator=g)
        rows = slice(backend.rank * B, (backend.rank + 1) * B)
        x, y = x[rows].to(backend.device), y[rows].to(backend.device)
        backend.backward(scale * nn.functional.cross_entropy(net(x), y))
        backend.step(opt)
    return backend.model_state_dict(net)


def main() -> int:
    p = argparse.ArgumentParser()
    parallelx.add_arguments(p)
    p.add_argument("--out", type=Path, required=True)
    add_stages(p)
    args, _ = p.parse_known_args()
    for out, options in stage_runs(args):
        run(args, out, **options)
    return 0


def run(args: argparse.Namespace, out: Path, **options: int) -> None:
    """Every run of :data:`RUNS` on one backend, into ``out``."""
    backend = parallelx.from_args(args, **options)
    backend.init()
    report: dict[str, Any] = {}
    for name, (wire, scale) in RUNS.items():
        try:
            backend.set_options(grad_compression=wire)
            weights = train(backend, scale)
        except ParallelxError as exc:
            report[name] = {"error": str(exc)}
            continue
        if backend.rank == 0:
            torch.save(weights, out / f"{name}.pt")
        report[name] = {"weights": f"{name}.pt"}
    if backend.rank == 0:
        (out / "report.json").write_text(json.dumps(report, indent=1))
    backend.shutdown()


if __name__ == "__main__":
    sys.exit(parallelx.exit_on_error(main)())
