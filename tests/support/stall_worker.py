"""Run under a launcher (2 processes): rank 1 stops taking part in the
collectives at step 3, alive; rank 0 must not wait for it for ever.

``--freeze sleep``: rank 1 sleeps for 10 minutes (a deadlock, stuck I/O).
``--freeze external``: rank 1 writes its pid to ``<out>/rank1.pid`` and keeps
training slowly until the test freezes it with SIGSTOP from outside.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import parallelx


def main() -> None:
    p = argparse.ArgumentParser()
    parallelx.add_arguments(p)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--freeze", choices=("sleep", "external"), required=True)
    args = p.parse_args()
    with parallelx.from_args(args) as backend:
        torch.manual_seed(0)
        model = backend.wrap_model(nn.Linear(4, 2))
        opt = backend.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        data = [(torch.randn(3, 4), torch.tensor([0, 1, 0])) for _ in range(10_000)]
        if args.freeze == "external" and backend.rank == 1:
            (args.out / "rank1.pid").write_text(str(os.getpid()))
        for step, (x, y) in enumerate(backend.batches(data)):
            if step == 3 and backend.rank == 1 and args.freeze == "sleep":
                time.sleep(600)
            if args.freeze == "external":
                time.sleep(0.05)
            backend.backward(nn.functional.cross_entropy(model(x.to(backend.device)), y.to(backend.device)))
            backend.step(opt)
            backend.print(f"step {step}")


if __name__ == "__main__":
    main()
