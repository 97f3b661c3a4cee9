"""What sharding saves: each rank's model-state memory and peak memory while
training the Dogs-vs-Cats VGG16 under ddp, DeepSpeed ZeRO 1-3 and fsdp.

    python -m benchmarks.memory --nproc 2 4 --image-size 32 --steps 3      # the table (minutes on 2 cores)
    python -m benchmarks.memory --tiny                                     # LeNet, 2 processes: a smoke test

Each case is one launch under the backend's own launcher; every rank trains
``--steps`` steps of SGD with momentum on synthetic batches and reports, after
the last backward (gradients and optimizer state both alive):

- params, grads: the bytes of this rank's own parameter and gradient tensors
  (a DTensor's local shard, a ZeRO-3 partition);
- model state: the bytes of every tensor alive in the process but the input
  batches (parameters, gradients, optimizer state, and what the backend adds:
  DDP's gradient buckets, ZeRO's fp32 partitions and flat buffers);
- peak RSS (CPU; ``ru_maxrss``, which also counts the whole model each rank
  builds before it is sharded) or ``max_memory_allocated`` (GPU);
- the median step time, as a ratio to ddp's at the same world size.

The table goes to stdout and ``--out`` (JSON).  Nothing is asserted about time.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import parallelx
from benchmarks.workload import Case, build_model, make_optimizer, synthetic_batches
from parallelx.launching import runner

#: name -> (backend, extra arguments)
CASES: dict[str, tuple[str, list[str]]] = {
    "ddp": ("ddp", []),
    **{f"zero{z}": ("deepspeed", ["--zero-stage", str(z)]) for z in (1, 2, 3)},
    # DeepSpeed's default reduce bucket (5e8 elements, 1.9 GiB in float32) is held by every ZeRO-3 rank.
    "zero3-bucket5e7": ("deepspeed", ["--zero-stage", "3", "--deepspeed-config", "{work}/bucket5e7.json"]),
    "fsdp": ("fsdp", []),
}
#: Configs the cases above name, written into the work folder.
CONFIGS = {"bucket5e7.json": {"zero_optimization": {"reduce_bucket_size": 50_000_000}}}


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's shard, a ZeRO-3 parameter's partition."""
    if hasattr(t, "to_local"):
        return t.to_local()
    return getattr(t, "ds_tensor", t)


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def live_tensor_bytes(exclude: set[int]) -> int:
    """Bytes of the distinct storages of every live tensor, but those in ``exclude`` (data_ptrs)."""
    seen, total = set(exclude), 0
    for obj in gc.get_objects():
        try:
            t = _local(obj) if torch.is_tensor(obj) else None
        except Exception:  # a half-built object
            continue
        if t is None or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def worker(args: argparse.Namespace) -> int:
    case = Case(model=args.model, batch=args.batch, image_size=args.image_size, warmup=1, steps=args.steps, lr=0.01)
    backend = parallelx.from_args(args)
    with backend:
        model = build_model(case)
        model, optimizer = backend.setup(model, make_optimizer(model, case))
        batches = synthetic_batches(case, backend.rank, backend.device)
        data = {t.untyped_storage().data_ptr() for b in batches for t in b}
        times, held = [], {}
        for i in range(case.warmup + case.steps):
            x, y = batches[i % len(batches)]
            start = time.perf_counter()
            with backend.autocast():
                loss = torch.nn.functional.cross_entropy(model(x), y)
            backend.backward(loss)
            if i == case.warmup + case.steps - 1:  # gradients and optimizer state both alive
                params = list(model.parameters())
                held = {
                    "params": _bytes(_local(p) for p in params),
                    "grads": _bytes(_local(p.grad) for p in params if p.grad is not None),
                    "model_state": live_tensor_bytes(data),
                }
            backend.step(optimizer)
            if i >= case.warmup:
                times.append(time.perf_counter() - start)
        peak = (
            torch.cuda.max_memory_allocated(backend.device)
            if backend.device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        )
        report = {
            **held,
            "peak": peak,
            "peak_kind": "max_memory_allocated" if backend.device.type == "cuda" else "peak RSS",
            "step_s": statistics.median(times),
            "world_size": backend.world_size,
            "comm": dist.get_backend() if dist.is_initialized() else None,
        }
        rows = backend.all_gather_object(report)
        if backend.is_main():
            Path(args.out).write_text(json.dumps(rows))
    return 0


def run_case(name: str, nproc: int, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    backend, extra = CASES[name]
    for file, config in CONFIGS.items():
        (work / file).write_text(json.dumps(config))
    extra = [a.format(work=work) for a in extra]
    out = work / f"{name}-n{nproc}.json"
    target = [
        "-m",
        "benchmarks.memory",
        "--worker",
        "--backend",
        backend,
        *extra,
        "--model",
        args.model,
        "--batch",
        str(args.batch),
        "--image-size",
        str(args.image_size),
        "--steps",
        str(args.steps),
        "--out",
        str(out),
        *(["--precision", args.precision] if args.precision else []),
    ]
    done = runner.launch(
        parallelx.describe(backend).launcher,
        target,
        nproc,
        timeout=args.launch_timeout,
        cwd=Path(__file__).resolve().parents[1],
        env={"OMP_NUM_THREADS": "1"},
    )
    if done.returncode != 0 or not out.is_file():
        print(
            f"{name} n={nproc}: failed (exit {done.returncode}):\n" + "\n".join(done.output.splitlines()[-15:]),
            file=sys.stderr,
        )
        return []
    return json.loads(out.read_text())


def table(results: dict[str, dict[int, list[dict[str, Any]]]]) -> str:
    mib = 2**20
    lines = [
        "| case | processes | params / rank | grads / rank | model state / rank | vs ddp | peak / rank | "
        "step time vs ddp |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, by_n in results.items():
        for n, rows in sorted(by_n.items()):
            if not rows:
                lines.append(f"| {name} | {n} | failed | | | | | |")
                continue
            ddp = results.get("ddp", {}).get(n) or rows
            worst = max(rows, key=lambda r: r["model_state"])
            ratio = worst["model_state"] / max(r["model_state"] for r in ddp)
            speed = statistics.mean(r["step_s"] for r in rows) / statistics.mean(r["step_s"] for r in ddp)
            lines.append(
                f"| {name} | {n} | {worst['params'] / mib:.0f} MiB | {worst['grads'] / mib:.0f} MiB | "
                f"{worst['model_state'] / mib:.0f} MiB | {ratio:.2f} | "
                f"{max(r['peak'] for r in rows) / mib:.0f} MiB ({rows[0]['peak_kind']}) | {speed:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parallelx.add_arguments(p)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    p.add_argument("--model", choices=("vgg16", "lenet"), default="vgg16")
    p.add_argument("--batch", type=int, default=2, help="images per process per step")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=3, help="timed steps (after one untimed)")
    p.add_argument("--launch-timeout", type=float, default=600, help="seconds per launch")
    p.add_argument("--tiny", action="store_true", help="LeNet, 2 processes, ddp and fsdp, 1 step: a smoke test")
    p.add_argument("--out", default=None, help="the JSON results (worker: its rows)")
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.tiny:
        args.model, args.nproc, args.cases, args.steps = "lenet", [2], ["ddp", "fsdp"], 1
    with tempfile.TemporaryDirectory() as work:
        results = {name: {n: run_case(name, n, args, Path(work)) for n in args.nproc} for name in args.cases}
    print(table(results), end="")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0 if all(rows for by_n in results.values() for rows in by_n.values()) else 1


if __name__ == "__main__":
    sys.exit(parallelx.exit_on_error(main)())
