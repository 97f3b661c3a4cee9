"""What ``--compile`` buys: the training step compiled against eager, for
LeNet (CIFAR-10's) and the GPT recipe's model, side by side in one run.

    python -m benchmarks.compile                                   # 1 process, LeNet and GPT (minutes on 2 cores)
    python -m parallelx launch ddp -n 2 -- -m benchmarks.compile   # 2 processes under torchrun
    python -m benchmarks.compile --models gpt --rounds 9

Each model is built twice from the same seed, one compiled by the backend
(``get_backend(..., compile=True)``: ddp's wrapper, fsdp's units, ...), one
eager; both train the same batches (kept on the device) with their own AdamW.
The first compiled steps, which compile, are timed apart ("compile time").
Then rounds alternate: a block of eager steps, a block of compiled steps, so
the machine's load drifts over both alike; the ratio of each round's median
step times gives the figure, with the spread over the rounds.  Rank 0 prints
the table and writes ``--out`` (JSON).  Nothing is asserted: a benchmark
reports.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import parallelx


def lenet_case(batch: int) -> tuple[Callable[[], nn.Module], Callable[[nn.Module, int], torch.Tensor]]:
    from recipes.models import LeNet

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)

    def loss(model: nn.Module, step: int) -> torch.Tensor:
        return nn.functional.cross_entropy(model(x), y)

    return (lambda: LeNet(num_classes=10)), loss


def gpt_case(batch: int) -> tuple[Callable[[], nn.Module], Callable[[nn.Module, int], torch.Tensor]]:
    from recipes.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=32, dropout=0.0)  # the recipe's model at its defaults, on 32 characters
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)

    def loss(model: nn.Module, step: int) -> torch.Tensor:
        logits = model(seq[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1), seq[:, 1:].flatten())

    return (lambda: GPT(cfg)), loss


CASES = {"lenet": (lenet_case, 64), "gpt": (gpt_case, 8)}


def timed_steps(backend: parallelx.Backend, model: nn.Module, opt: Any, loss: Any, n: int) -> list[float]:
    times = []
    for s in range(n):
        if backend.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        backend.backward(loss(model, s))
        backend.step(opt)
        if backend.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    make, batch = CASES[name]
    build, loss = make(args.batch or batch)
    runs = {}
    for mode in ("eager", "compiled"):
        backend = parallelx.get_backend(args.backend, compile=mode == "compiled").init()
        torch.manual_seed(0)
        model = build()
        model, opt = backend.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        start = time.perf_counter()
        timed_steps(backend, model, opt, loss, args.warmup)
        runs[mode] = {"backend": backend, "model": model, "opt": opt, "warmup_s": time.perf_counter() - start}
    eager, compiled, ratios = [], [], []
    for _ in range(args.rounds):
        e = statistics.median(
            timed_steps(runs["eager"]["backend"], runs["eager"]["model"], runs["eager"]["opt"], loss, args.steps)
        )
        c = statistics.median(
            timed_steps(
                runs["compiled"]["backend"], runs["compiled"]["model"], runs["compiled"]["opt"], loss, args.steps
            )
        )
        eager.append(e)
        compiled.append(c)
        ratios.append(c / e)
    rank = runs["eager"]["backend"].rank
    for mode in ("compiled", "eager"):  # the first one made the process group: it goes last
        runs[mode]["backend"].shutdown()
    ratios.sort()
    return {
        "model": name,
        "rank": rank,
        "backend": runs["eager"]["backend"].name,  # what "auto" chose
        "world_size": runs["eager"]["backend"].world_size,
        "eager_step_ms": 1e3 * statistics.median(eager),
        "compiled_step_ms": 1e3 * statistics.median(compiled),
        "ratio": statistics.median(ratios),
        "ratio_range": [ratios[0], ratios[-1]],
        "rounds": args.rounds,
        "compile_s": runs["compiled"]["warmup_s"] - runs["eager"]["warmup_s"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--backend", default="auto", help="the backend (auto: the launcher's, else single)")
    p.add_argument("--models", default="lenet,gpt", help="comma-separated: lenet, gpt")
    p.add_argument("--batch", type=int, default=None, help="samples per process (default: 64 LeNet, 8 GPT)")
    p.add_argument("--warmup", type=int, default=3, help="steps before timing (the compiled model compiles here)")
    p.add_argument("--steps", type=int, default=10, help="steps per round per mode")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (eager, compiled)")
    p.add_argument("--out", type=Path, default=Path("runs/bench/compile.json"))
    args = p.parse_args(argv)
    rows = [measure(name.strip(), args) for name in args.models.split(",") if name.strip()]
    if rows and rows[0]["rank"] == 0:
        print(
            "| model | backend | processes | eager step | compiled step | compiled / eager (range over rounds) "
            "| compile time |"
        )
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['model']} | {r['backend']} | {r['world_size']} | {r['eager_step_ms']:.1f} ms | "
                f"{r['compiled_step_ms']:.1f} ms | {r['ratio']:.2f} ({r['ratio_range'][0]:.2f}-"
                f"{r['ratio_range'][1]:.2f}, {r['rounds']} rounds) | {r['compile_s']:.1f} s |"
            )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
