"""What logging and throughput accounting cost per training step: the same loop
with ``--logger`` and the throughput meter, and without them, side by side in one
process (benchmarks/README.md, "Trackers and throughput: their cost")::

    python -m benchmarks.tracking                       # LeNet, batch 64, 60 blocks of 10 steps each way
    python -m benchmarks.tracking --loggers tensorboard,mlflow,csv --blocks 100

Two ``single`` backends train two copies of the same model on the same batches,
one with the trackers (their writer thread, ``backend.log_metrics`` of the loss
and the learning rate every step, the throughput meter and its FLOP count, an
interval every ``--log-every`` steps), one without.  Blocks of timed steps
alternate between them (monitored first, then plain first, ...), each taken from
one long pass over the loader per backend, so that intervals fall where they do
in training.  The cost is the ratio of median step times, with its 95 %
bootstrap interval over the blocks.  On a GPU each block ends with a
synchronisation (both sides alike), and the monitored side counts the
synchronising calls it makes (``torch.cuda.set_sync_debug_mode``): the meter and
the trackers should add one per interval, none per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

import parallelx
from benchmarks import stats
from parallelx.cli import exit_on_error, positive_int
from parallelx.launching import envreport
from parallelx.observability import throughput
from recipes.models import LeNet

ROOT = Path(__file__).resolve().parents[1]


class Batches:
    """``n`` batches of the same few tensors, with a length (as a DataLoader has)."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]], n: int) -> None:
        self.batches, self.n = batches, n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return (self.batches[i % len(self.batches)] for i in range(self.n))


class Side:
    """One backend, its model and optimizer, and its one pass over the batches."""

    def __init__(self, backend: parallelx.Backend, batches: Batches, *, log: bool) -> None:
        self.backend, self.log = backend.init(), log
        parallelx.seed_everything(0)
        model = LeNet()
        self.model, self.opt = backend.setup(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
        self.steps = iter(backend.batches(batches))
        self.criterion = nn.CrossEntropyLoss()
        self.block_times: list[list[float]] = []
        self.syncs = 0
        self.log_s: list[float] = []  # host time inside each log_metrics call, timed blocks only

    def run(self, k: int, *, timed: bool = True) -> None:
        """``k`` steps; one synchronisation at the end (on a GPU), counted in the block's time."""
        device = self.backend.device
        with warnings.catch_warnings(record=True) as caught:
            if device.type == "cuda" and self.log:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
            start = time.perf_counter()
            for _ in range(k):
                x, y = next(self.steps)
                loss = self.criterion(self.model(x), y)
                self.backend.backward(loss)
                self.backend.step(self.opt)
                if self.log:
                    t = time.perf_counter()
                    self.backend.log_metrics({"train/loss": loss, "lr": self.opt.param_groups[0]["lr"]})
                    if timed:
                        self.log_s.append(time.perf_counter() - t)
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - start
        if timed:
            self.block_times.append([seconds / k])
            self.syncs += sum("synchroniz" in str(w.message) for w in caught)


def marks_us(batch: tuple[torch.Tensor, torch.Tensor], chunks: int = 200, steps: int = 100) -> float:
    """Host microseconds the meter's four marks of one step take: the median over
    chunks of ``steps`` steps, each chunk's interval closed untimed."""
    meter = throughput.StepMeter(batch[0].device, world_size=1, reduce_sum=lambda t: t, peak=None, count_flops=False)
    times = []
    for _ in range(chunks):
        start = time.perf_counter()
        for _ in range(steps):
            meter.requested()
            meter.ready(batch)
            meter.backward_done()
            meter.step_done()
        times.append((time.perf_counter() - start) / steps)
        meter.interval()
    return statistics.median(times) * 1e6


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tracking", description=__doc__.splitlines()[0])
    p.add_argument(
        "--loggers", default="tensorboard,csv", help="the trackers of the monitored side (default: %(default)s)"
    )
    p.add_argument("--batch", type=positive_int, default=64, help="LeNet images per step (default: %(default)s)")
    p.add_argument("--blocks", type=positive_int, default=60, help="timed blocks of each side (default: %(default)s)")
    p.add_argument("--steps", type=positive_int, default=10, help="steps per block (default: %(default)s)")
    p.add_argument(
        "--log-every", type=positive_int, default=50, help="steps per logging interval (default: %(default)s)"
    )
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--threads", type=positive_int, default=1, help="torch's CPU threads (default: %(default)s)")
    p.add_argument(
        "--out-dir",
        type=Path,
        default=ROOT / "benchmarks" / "results" / "tracking",
        help="results.md and summary.json (default: %(default)s)",
    )
    return p.parse_args(argv)


def measure(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    warmup = 3
    total = (warmup + args.blocks) * args.steps + 1
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(args.batch, 3, 32, 32, generator=g), torch.randint(0, 10, (args.batch,), generator=g))]
    if device == "cuda":
        data = [(x.cuda(), y.cuda()) for x, y in data]
    monitored = parallelx.get_backend(
        "single", device=device, loggers=args.loggers, log_dir=run_dir, monitor={"log_every": args.log_every}
    )
    a = Side(monitored, Batches(data, total), log=True)
    b = Side(parallelx.get_backend("single", device=device), Batches(data, total), log=False)
    for side in (a, b):
        side.run(warmup * args.steps, timed=False)
    monitored.monitor.flush()
    monitored.monitor.wait_written()  # the trackers opened (imports, files, a database) before timing starts
    for block in range(args.blocks):
        first, second = (a, b) if block % 2 == 0 else (b, a)
        first.run(args.steps)
        second.run(args.steps)
    latest = dict(monitored.monitor.latest)
    monitored.shutdown()
    b.backend.shutdown()
    rows = [
        {
            "rounds": list(range(args.blocks)),
            "round_step_times_s": side.block_times,
            "step_s": [t[0] for t in side.block_times],
        }
        for side in (a, b)
    ]
    ratios = [x / y for x, y in zip(rows[0]["step_s"], rows[1]["step_s"])]
    return {
        "monitored_ms": 1000 * statistics.median(rows[0]["step_s"]),
        "plain_ms": 1000 * statistics.median(rows[1]["step_s"]),
        "ratio": statistics.median(rows[0]["step_s"]) / statistics.median(rows[1]["step_s"]),
        "ci95": stats.round_interval(rows[0], rows[1], lambda x, y: x / y),
        "blocks_monitored_faster": sum(r < 1 for r in ratios),
        "block_ratio_range": [min(ratios), max(ratios)],
        "syncs_per_step": a.syncs / (args.blocks * args.steps) if device == "cuda" else None,
        "log_metrics_us": statistics.median(a.log_s) * 1e6,
        "marks_us": marks_us(data[0]),
        "device": device,
        "last_interval": latest,
    }


def markdown(result: dict[str, Any], meta: dict[str, Any]) -> str:
    r = result
    ci = "[{:.3f}, {:.3f}]".format(*r["ci95"]) if r["ci95"] else "n/a"
    syncs = "not measured (CPU)" if r["syncs_per_step"] is None else f"{r['syncs_per_step']:.3f}"
    return (
        "# Trackers and throughput: their cost per step\n\n"
        f"`{meta['command']}` ({meta['wall_s']:.0f} s, {meta['started']}, load average "
        f"{meta['load_average_start'][0]:.1f} at the start)\n\n"
        "| side | median step ms |\n|---|---:|\n"
        f"| with `--logger {meta['loggers']}`, throughput, log_metrics every step | {r['monitored_ms']:.3f} |\n"
        f"| without | {r['plain_ms']:.3f} |\n\n"
        f"- ratio with / without: **{r['ratio']:.4f}** {ci} (95 % bootstrap interval over {meta['blocks']} blocks)\n"
        f"- blocks with the monitored side faster: {r['blocks_monitored_faster']} of {meta['blocks']}; "
        f"single-block ratios {r['block_ratio_range'][0]:.3f} to {r['block_ratio_range'][1]:.3f}\n"
        f"- synchronising calls per step on the monitored side: {syncs}\n"
        f"- host time per step (medians): `log_metrics` {r['log_metrics_us']:.1f} µs, the meter's four marks "
        f"{r['marks_us']:.1f} µs (without the trackers' thread and the intervals; "
        f"{(r['log_metrics_us'] + r['marks_us']) / 10 / r['plain_ms']:.3f} % of a step)\n"
        f"- device {r['device']}; last interval's figures: "
        + ", ".join(f"{k} {v:.4g}" for k, v in r["last_interval"].items())
        + "\n"
    )


@exit_on_error
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started, load = time.time(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="parallelx-tracking-") as tmp:
        result = measure(args, Path(tmp))
    meta = {
        "command": "python -m benchmarks.tracking " + " ".join(argv if argv is not None else sys.argv[1:]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "wall_s": round(time.time() - started, 1),
        "load_average_start": load,
        "loggers": args.loggers,
        "blocks": args.blocks,
        "steps_per_block": args.steps,
        "batch": args.batch,
        "log_every": args.log_every,
        "threads": args.threads,
        "hardware": envreport.hardware(),
        "versions": envreport.versions(),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "summary.json").write_text(json.dumps({"meta": meta, "result": result}, indent=2) + "\n")
    (args.out_dir / "results.md").write_text(markdown(result, meta))
    print(markdown(result, meta), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
