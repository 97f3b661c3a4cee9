"""Each engine's own step against parallelx's, in the same processes: alternated step pairs.

    python -m parallelx launch ddp -n 2 -- -m benchmarks.step_ab --engines ddp fsdp --pairs 100
    python -m parallelx launch deepspeed -n 2 -- -m benchmarks.step_ab --engines zero0 zero1 zero2 zero3 --pairs 100

The GPT of ``benchmarks/engine_steps.py`` (``--job small``: 4 blocks of width 256, context 128,
batch 16; AdamW in two groups, tied embedding), float32.  Both implementations are built from the
same seed; each pair runs them in alternating order on the same batch, and the loss sequences must
be equal before any time is reported.  Rank 0 prints, per engine, the median step times, the median
of the per-pair ratios parallelx / engine and their quartiles.  ``--profile DIR`` writes a cProfile
of each implementation's steps per rank (``python -m pstats``), which counts calls and host time
whatever else runs on the machine.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks import engine_steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", required=True, choices=sorted(engine_steps.ENGINES))
    parser.add_argument("--job", choices=sorted(engine_steps.JOBS), default="small")
    parser.add_argument("--pairs", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--profile", default=None, metavar="DIR", help="write a cProfile of each side per rank")
    args, _ = parser.parse_known_args()  # the launchers add --backend, --local_rank
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("WORLD_SIZE", "1"))))
    engine_steps.init_world(engine_steps.ENGINES[args.engines[0]][0])
    job = engine_steps.JOBS[args.job]
    for engine in args.engines:
        with engine_steps.px_backend(engine, job).init() as backend:
            steps = {
                "raw": engine_steps.raw_step(engine, job, backend.device)[0],
                "parallelx": engine_steps.px_step(backend, job)[0],
            }
            times: dict[str, list[float]] = {"raw": [], "parallelx": []}
            losses: dict[str, list[float]] = {"raw": [], "parallelx": []}
            profiles = {k: cProfile.Profile() for k in steps}
            for i in range(args.warmup + args.pairs):
                x, y = engine_steps.batch(job, backend.rank, i, backend.device)
                for impl in ("raw", "parallelx") if i % 2 == 0 else ("parallelx", "raw"):
                    dist.barrier()
                    profile = profiles[impl] if args.profile and i >= args.warmup else None
                    start = time.perf_counter()
                    if profile is not None:
                        profile.enable()
                    loss = steps[impl](x, y)
                    if profile is not None:
                        profile.disable()
                    elapsed = time.perf_counter() - start
                    losses[impl].append(float(loss.detach()))
                    if i >= args.warmup:
                        times[impl].append(elapsed)
            if losses["raw"] != losses["parallelx"]:
                print(f"{engine}: the loss sequences differ; no time reported", file=sys.stderr)
                return 1
            if args.profile:
                Path(args.profile).mkdir(parents=True, exist_ok=True)
                for impl, profile in profiles.items():
                    profile.dump_stats(str(Path(args.profile) / f"{engine}-{impl}.rank{backend.rank}.prof"))
            ratios = sorted(p / r for p, r in zip(times["parallelx"], times["raw"], strict=True))
            q = statistics.quantiles(ratios, n=4)
            if backend.rank == 0:
                print(
                    f"{engine}: raw {statistics.median(times['raw']) * 1e3:.1f} ms, parallelx "
                    f"{statistics.median(times['parallelx']) * 1e3:.1f} ms, parallelx / raw median "
                    f"{statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f}) over {args.pairs} pairs, "
                    "losses equal",
                    flush=True,
                )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
