"""Tensor parallelism's memory and step time, side by side: the same GPT at 4 processes as fsdp
(data parallel 4), fsdp tensor parallel 2 x data parallel 2, and ddp tensor parallel 2 x data
parallel 2, each with and without ``--sequence-parallel``; on request, with the loss on the head's
vocabulary shards (``--loss-parallel``, the ``+ lp`` configurations: ``--job vocab`` is where it shows).

    python -m benchmarks.tensor_parallel                       # the 200 M GPT, one round
    python -m benchmarks.tensor_parallel --job small --rounds 1 --steps 3
    python -m benchmarks.tensor_parallel --job vocab --configs "ddp tp2 x dp2" "ddp tp2 x dp2 + lp"

Each configuration is a launch of its own (torchrun, 4 processes, Gloo on the CPU), in alternating
order over the rounds.  A launch builds the GPT from one seed, trains ``--steps`` AdamW steps after
one of warm-up on the same batches in every configuration, and reports rank 0's median step time,
every rank's peak resident memory (``ru_maxrss``), the state each rank holds after the first step
(parameters, gradients and optimizer moments, counted from the tensors themselves), and the loss
sequence; the table puts each configuration beside fsdp at data parallel 4 as ratios, and beside
each the state estimate: (whole tensors + split tensors / N) / FSDP2's data-parallel shards,
x 4 (a parameter, its gradient, two Adam moments).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

JOBS = {
    # ~200 M parameters in the blocks (16 x 12 x 1024^2), a vocabulary of 8192 (8 M, tied).
    "200m": {"n_layer": 16, "n_head": 16, "n_embd": 1024, "vocab": 8192, "block": 256, "batch": 1},
    "small": {"n_layer": 2, "n_head": 4, "n_embd": 128, "vocab": 512, "block": 64, "batch": 4},
    # Where the logits are most of the memory (a large vocabulary on a narrow model): --loss-parallel's case.
    "vocab": {"n_layer": 2, "n_head": 4, "n_embd": 256, "vocab": 65536, "block": 512, "batch": 2},
}
CONFIGS = {
    "fsdp dp4": ("fsdp", []),
    "fsdp tp2 x dp2": ("fsdp", ["--tensor-parallel", "2"]),
    "fsdp tp2 x dp2 + sp": ("fsdp", ["--tensor-parallel", "2", "--sequence-parallel"]),
    "ddp tp2 x dp2": ("ddp", ["--tensor-parallel", "2"]),
    "ddp tp2 x dp2 + sp": ("ddp", ["--tensor-parallel", "2", "--sequence-parallel"]),
    # The loss on the head's vocabulary shards (not in the default list: ask for them, with --job vocab).
    "ddp tp2 x dp2 + lp": ("ddp", ["--tensor-parallel", "2", "--loss-parallel"]),
    "fsdp tp2 x dp2 + lp": ("fsdp", ["--tensor-parallel", "2", "--loss-parallel"]),
}
DEFAULT_CONFIGS = [c for c in CONFIGS if not c.endswith("+ lp")]


def gpt(job: dict[str, int]) -> Any:
    """The recipe's GPT of ``job``'s sizes, without dropout (also benchmarks/checkpoint_save.py's)."""
    from recipes.models import GPT, GPTConfig

    return GPT(
        GPTConfig(
            vocab_size=job["vocab"],
            block_size=job["block"],
            n_layer=job["n_layer"],
            n_head=job["n_head"],
            n_embd=job["n_embd"],
            dropout=0.0,
        )
    )


# ------------------------------------------------------------------ one launch
def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    import parallelx

    job = JOBS[args.job]
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("WORLD_SIZE", "1"))))
    backend = parallelx.from_args(args)
    with backend:
        torch.manual_seed(0)
        model = gpt(job)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, opt = backend.setup(model, opt)
        mesh = backend.mesh
        g = torch.Generator().manual_seed(1234)
        times, losses = [], []
        state_bytes = 0
        for step in range(args.steps + 1):
            # The same global batch in every configuration (4 x batch rows), cut by the data-parallel rank.
            x = torch.randint(0, job["vocab"], (job["batch"] * 4, job["block"]), generator=g)
            x = x.chunk(mesh.data_size)[mesh.data_rank]
            backend.barrier()
            start = time.perf_counter()
            logits = model(x)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
            backend.backward(loss)
            backend.step(opt)
            backend.barrier()
            if step == 0:
                state_bytes = _held_bytes(model, opt)
            else:
                times.append(time.perf_counter() - start)
            value = loss.detach()
            value = value.full_tensor() if hasattr(value, "full_tensor") else value  # --loss-parallel's DTensor
            losses.append(float(backend.all_reduce(value, "mean")))
        peak = backend.all_gather_object(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        held = backend.all_gather_object(state_bytes)
        if backend.rank == 0:
            Path(args.out).write_text(
                json.dumps({"step_s": statistics.median(times), "peak": peak, "held": held, "losses": losses})
            )


def _held_bytes(model: Any, opt: Any) -> int:
    """Parameters, gradients and optimizer state this rank holds, counted from the tensors."""
    import torch

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += local(p).numel() * local(p).element_size()
        if p.grad is not None:
            total += local(p.grad).numel() * local(p.grad).element_size()
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim():
                total += local(v).numel() * local(v).element_size()
    return total


def estimate(job: dict[str, int], config: str) -> float:
    """Bytes per rank of parameters, gradients and Adam's two moments: split tensors / N, all / FSDP2's shards."""
    c, layers, vocab, block = job["n_embd"], job["n_layer"], job["vocab"], job["block"]
    # The blocks' Linear weights and biases, and the token embedding (tied to the head: its vocabulary split).
    split = layers * 12 * c * c + layers * (3 * c + c + 4 * c + c) + vocab * c
    whole = block * c + layers * 4 * c + 2 * c  # the position embedding, the norms
    tp = 2 if "tp2" in config else 1
    shards = 4 // tp if config.startswith("fsdp") else 1
    return 4 * 4 * (whole + split / tp) / shards


# ------------------------------------------------------------------ the driver
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", choices=sorted(JOBS), default="200m")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    if "--worker" in sys.argv:
        import parallelx

        parallelx.add_arguments(parser)
        worker(parser.parse_args())
        return 0
    args = parser.parse_args()
    from parallelx.launching import runner
    from parallelx.registry import describe

    results: dict[str, list[dict[str, Any]]] = {c: [] for c in args.configs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = args.configs if r % 2 == 0 else list(reversed(args.configs))
            for config in order:
                backend, extra = CONFIGS[config]
                out = Path(tmp) / f"{config.replace(' ', '_')}-{r}.json"
                target = ["benchmarks/tensor_parallel.py", "--worker", "--job", args.job, "--steps", str(args.steps)]
                target += ["--out", str(out), "--backend", backend, "--device", "cpu", *extra]
                print(f"round {r + 1}/{args.rounds}: {config} ...", flush=True)
                done = runner.launch(describe(backend).launcher, target, 4, timeout=args.timeout, cwd=ROOT)
                if done.returncode != 0 or not out.exists():
                    print(done.output[-3000:])
                    print(f"{config} failed (exit {done.returncode})")
                    return 1
                results[config].append(json.loads(out.read_text()))
    base = results[args.configs[0]]
    reference = base[0]["losses"]
    print(f"\njob {args.job}: {JOBS[args.job]}, 4 processes, {args.steps} steps after 1, {args.rounds} rounds")
    print(
        "| configuration | step (s) | x first | peak RSS / rank (GiB) | x first | held / rank (MiB) | estimate (MiB) "
        "| losses against the first (relative) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for config, runs in results.items():
        step = statistics.median(run["step_s"] for run in runs)
        peak = statistics.median(max(run["peak"]) for run in runs)
        held = max(runs[0]["held"])
        base_step = statistics.median(run["step_s"] for run in base)
        base_peak = statistics.median(max(run["peak"]) for run in base)
        drift = max(abs(a - b) / abs(b) for a, b in zip(runs[0]["losses"], reference))
        print(
            f"| {config} | {step:.3f} | {step / base_step:.2f} | {peak / 2**30:.2f} | {peak / base_peak:.2f} | "
            f"{held / 2**20:.0f} | {estimate(JOBS[args.job], config) / 2**20:.0f} | {drift:.1e} |"
        )
        if os.environ.get("BENCH_VERBOSE"):
            print(runs[0]["losses"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
