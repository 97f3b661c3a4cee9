"""What the record of each rank's collectives costs per step (docs/hangs.md).

    .venv/bin/torchrun --nproc-per-node 2 -m benchmarks.forensics --backend ddp --blocks 12 --steps 10

The GPT recipe's model and step (``recipes/gpt.py``'s defaults: 4 blocks, 96 wide, context 64,
batch 12: forward, ``backend.backward``, ``backend.step``; with ``--all-reduce`` one
``all_reduce`` of the loss per step besides, which the recipe does not do), in one launch: blocks of timed steps with
the record on and off alternate (on, off, off, on, ...), so that both meet the same process and
moment on a shared machine.  "Off" is the code without the record: every recording call and the
shape agreement of ``all_reduce``/``broadcast`` replaced by nothing; the exchange's thread (one
store check twice a second) runs in both.  Prints the median step time of each and the overhead.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import parallelx
from parallelx.forensics import record
from parallelx.parts.collectives import Collectives
from recipes.models import GPT, GPTConfig


@contextlib.contextmanager
def record_off(shapes: bool) -> Iterator[None]:
    patches: dict[tuple[Any, str], Any] = {
        (record, "watched"): lambda what, guard: guard,
        (record, "call"): lambda *a, **k: contextlib.nullcontext(),
        (record, "describe"): lambda *t: None,
    }
    if not shapes:
        patches[(Collectives, "agree_shapes")] = lambda self, kind, tensor: None
    saved = {key: getattr(*key) for key in patches}
    for (owner, name), value in patches.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)


def main() -> None:
    p = argparse.ArgumentParser()
    parallelx.add_arguments(p)
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--all-reduce", action="store_true", help="one all_reduce of the loss per step besides")
    p.add_argument("--shapes-in-both", action="store_true", help="the shape agreement in both arms: the record alone")
    args = p.parse_args()
    with parallelx.from_args(args) as backend:
        torch.manual_seed(0)
        config = GPTConfig(vocab_size=65)
        net = GPT(config)
        model, optimizer = backend.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
        x = torch.randint(0, 65, (args.batch, config.block_size), device=backend.device)
        y = torch.randint(0, 65, (args.batch, config.block_size), device=backend.device)

        def step() -> Any:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            backend.backward(loss)
            backend.step(optimizer)
            return backend.all_reduce(loss.detach(), "mean") if args.all_reduce else loss

        def block() -> float:
            backend.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            return (time.perf_counter() - start) / args.steps

        for _ in range(3):
            step()
        times: dict[str, list[float]] = {"on": [], "off": []}
        for i in range(args.blocks):
            for arm in ("on", "off") if i % 2 == 0 else ("off", "on"):
                with record_off(args.shapes_in_both) if arm == "off" else contextlib.nullcontext():
                    times[arm].append(block())
        on, off = statistics.median(times["on"]), statistics.median(times["off"])
        overhead = (on - off) / off * 100
        backend.print(
            f"forensics record: {backend.name} x{backend.world_size}, GPT recipe step"
            f"{' + all_reduce' if args.all_reduce else ''}{' (shape agreement in both)' if args.shapes_in_both else ''}: "
            f"on {on * 1000:.2f} ms, off {off * 1000:.2f} ms (medians of {args.blocks} blocks of {args.steps} "
            f"steps): overhead {overhead:+.2f} %"
        )


if __name__ == "__main__":
    main()
