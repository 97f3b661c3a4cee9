"""One launch per launcher: for each of its engines, the engine's own training step and parallelx's
on the same GPT in the same processes, each run twice, then once counted
(``benchmarks/engine_steps.py``: collectives with their bytes, host reads); each rank writes
``rank<r>.json`` with both counts and both loss sequences.

    torchrun --nproc-per-node 2 tests/support/step_counts_worker.py --launcher torchrun --out DIR
    deepspeed --num_gpus 2 tests/support/step_counts_worker.py --launcher deepspeed --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import engine_steps  # noqa: E402

engine_steps.enable_flight_recorder()  # before any process group

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

#: Steps of each implementation before the counted one (the optimizer's state, DeepSpeed's engine and
#: every once-per-run agreement are made in the first).
WARMUP = 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launcher", required=True, choices=("torchrun", "deepspeed"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--backend", help="(the launch helpers name one; the launcher's engines all run)")
    args, _ = parser.parse_known_args()  # the deepspeed launcher adds --local_rank
    torch.set_num_threads(1)
    engine_steps.init_world(args.launcher)  # parallelx's backends adopt the group, and leave it
    job = engine_steps.COUNTED
    report: dict[str, dict] = {}
    for engine, (launcher, _) in engine_steps.ENGINES.items():
        if launcher != args.launcher:
            continue
        with engine_steps.px_backend(engine, job).init() as backend:
            steps = {
                "raw": engine_steps.raw_step(engine, job, backend.device)[0],
                "parallelx": engine_steps.px_step(backend, job)[0],
            }
            entry: dict[str, dict] = {}
            for impl, step in steps.items():
                losses = []
                for i in range(WARMUP):
                    losses.append(float(step(*engine_steps.batch(job, backend.rank, i, backend.device))))
                loss, counts = engine_steps.count_step(
                    step, *engine_steps.batch(job, backend.rank, WARMUP, backend.device)
                )
                losses.append(float(loss))
                entry[impl] = {**counts.as_dict(), "losses": losses}
            report[engine] = entry
    if args.launcher == "torchrun":
        report["precisions"] = precisions(engine_steps.TINY)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def precisions(job: engine_steps.Job) -> dict[str, dict]:
    """parallelx's fsdp step counted under bf16-mixed (autocast over float32 FSDP2: float32 gathers) and
    bf16-compute (FSDP2 gathers bfloat16 copies, reduces float32 gradients)."""
    import parallelx

    seen: dict[str, dict] = {}
    for precision in ("bf16-mixed", "bf16-compute"):
        with parallelx.get_backend("fsdp", precision=precision, device="cpu", verbose=False) as backend:
            step = engine_steps.px_step(backend, job)[0]
            for i in range(WARMUP):
                step(*engine_steps.batch(job, backend.rank, i, backend.device))
            _, counts = engine_steps.count_step(step, *engine_steps.batch(job, backend.rank, WARMUP, backend.device))
            seen[precision] = counts.as_dict()
    return seen


if __name__ == "__main__":
    sys.exit(main())
