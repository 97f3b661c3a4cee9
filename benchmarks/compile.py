"""What ``--compile`` buys: the training step compiled against eager, for
LeNet (CIFAR-10's) and the GPT recipe's model, side by side in one run.

    python -m benchmarks.compile                                   # 1 process, LeNet and GPT (minutes on 2 cores)
    python -m parallelx launch ddp -n 2 -- -m benchmarks.compile   # 2 processes under torchrun
    python -m benchmarks.compile --models gpt --rounds 9
    python -m benchmarks.compile --models gpt --dropout 0.1 --compile-random both   # the cost of eager's masks

Each model is built twice from the same seed, one compiled by the backend
(``get_backend(..., compile=True)``: ddp's wrapper, fsdp's units, ...), one
eager; both train the same batches (kept on the device) with their own AdamW.
The first compiled steps, which compile, are timed apart ("compile time").
With ``--compile-random both`` the GPT is compiled twice, drawing eager's random numbers
(parallelx's default: the same dropout masks as eager) and inductor's own, and the three
alternate.
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


def lenet_case(
    batch: int, dropout: float = 0.0
) -> tuple[Callable[[], nn.Module], Callable[[nn.Module, int], torch.Tensor]]:
    from recipes.models import LeNet

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)

    def loss(model: nn.Module, step: int) -> torch.Tensor:
        return nn.functional.cross_entropy(model(x), y)

    return (lambda: LeNet(num_classes=10)), loss


def gpt_case(
    batch: int, dropout: float = 0.0
) -> tuple[Callable[[], nn.Module], Callable[[nn.Module, int], torch.Tensor]]:
    from recipes.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=32, dropout=dropout)  # the recipe's model at its defaults, on 32 characters
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
    from parallelx.transforms.compiling import CompileOptions

    make, batch = CASES[name]
    build, loss = make(args.batch or batch, args.dropout)
    randomness = ("eager", "inductor") if args.compile_random == "both" else (args.compile_random,)
    modes: dict[str, Any] = {"eager": False}
    for r in randomness:
        modes["compiled" if r == "eager" else "compiled, inductor's random"] = CompileOptions(
            enabled=True, eager_random=r == "eager"
        )
    runs = {}
    for mode, compile_ in modes.items():
        backend = parallelx.get_backend(args.backend, compile=compile_).init()
        torch.manual_seed(0)
        model = build()
        model, opt = backend.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        start = time.perf_counter()
        timed_steps(backend, model, opt, loss, args.warmup)
        runs[mode] = {"backend": backend, "model": model, "opt": opt, "warmup_s": time.perf_counter() - start}
    medians: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(args.rounds):  # alternating, so the machine's drift falls on every mode alike
        for mode, r in runs.items():
            medians[mode].append(statistics.median(timed_steps(r["backend"], r["model"], r["opt"], loss, args.steps)))
    first = runs["eager"]["backend"]
    rank, backend_name, world = first.rank, first.name, first.world_size
    for mode in reversed(list(runs)):  # the first one made the process group: it goes last
        runs[mode]["backend"].shutdown()
    row: dict[str, Any] = {
        "model": name,
        "rank": rank,
        "backend": backend_name,  # what "auto" chose
        "world_size": world,
        "dropout": args.dropout,
        "eager_step_ms": 1e3 * statistics.median(medians["eager"]),
        "rounds": args.rounds,
        "compiled": {},
    }
    for mode in list(modes)[1:]:
        ratios = sorted(c / e for c, e in zip(medians[mode], medians["eager"], strict=True))
        row["compiled"][mode] = {
            "step_ms": 1e3 * statistics.median(medians[mode]),
            "ratio": statistics.median(ratios),
            "ratio_range": [ratios[0], ratios[-1]],
            "compile_s": runs[mode]["warmup_s"] - runs["eager"]["warmup_s"],
        }
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--backend", default="auto", help="the backend (auto: the launcher's, else single)")
    p.add_argument("--models", default="lenet,gpt", help="comma-separated: lenet, gpt")
    p.add_argument("--batch", type=int, default=None, help="samples per process (default: 64 LeNet, 8 GPT)")
    p.add_argument("--warmup", type=int, default=3, help="steps before timing (the compiled model compiles here)")
    p.add_argument("--steps", type=int, default=10, help="steps per round per mode")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (eager, compiled)")
    p.add_argument("--dropout", type=float, default=0.0, help="the GPT's dropout (default 0)")
    p.add_argument(
        "--compile-random",
        choices=("eager", "inductor", "both"),
        default="eager",
        help="whose random numbers the compiled model draws: eager's (parallelx's default), inductor's, or both",
    )
    p.add_argument("--out", type=Path, default=Path("runs/bench/compile.json"))
    args = p.parse_args(argv)
    rows = [measure(name.strip(), args) for name in args.models.split(",") if name.strip()]
    if rows and rows[0]["rank"] == 0:
        print(
            "| model | backend | processes | dropout | eager step | compiled | step | compiled / eager "
            "(range over rounds) | compile time |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            for mode, c in r["compiled"].items():
                print(
                    f"| {r['model']} | {r['backend']} | {r['world_size']} | {r['dropout']} | "
                    f"{r['eager_step_ms']:.1f} ms | {mode} | {c['step_ms']:.1f} ms | {c['ratio']:.2f} "
                    f"({c['ratio_range'][0]:.2f}-{c['ratio_range'][1]:.2f}, {r['rounds']} rounds) | "
                    f"{c['compile_s']:.1f} s |"
                )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
