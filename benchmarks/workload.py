"""What every benchmark worker shares, so that the work is identical: the plan
(cases to run), model, optimizer, synthetic batches, step timer and result
files.  Nothing here is distributed: each worker owns its process group,
wrapping and step, so two workers' step times differ by their training paths
alone.  ``benchmarks.run`` writes a plan per launch (``--work-dir`` keeps them)::

    python -m parallelx launch ddp -n 2 -- -m benchmarks.px_worker --plan DIR/plans/px-ddp-n2-r0.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallelx.errors import ParallelxError

#: Classes and training-set sizes of the datasets the synthetic batches stand
#: in for (CIFAR-10: 50,000; Dogs-vs-Cats: the 80 % split of 25,000 that recipes/dogcat.py trains on).
MODELS: dict[str, dict[str, int]] = {
    "lenet": {"classes": 10, "train_images": 50_000},
    "vgg16": {"classes": 2, "train_images": 20_000},
}
#: One training step on a batch, returning the loss: what every worker's
#: ``prepare`` builds, so that ``same_process`` can run two side by side.
Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: Distinct batches per rank, cycled: no step sees its predecessor's input, and all stay in memory.
POOL = 4
HAS_AFFINITY = hasattr(os, "sched_setaffinity")
# The cores this worker was started with, before apply_threads narrowed them.
_STARTED_ON = sorted(os.sched_getaffinity(0)) if HAS_AFFINITY else None


class BenchError(ParallelxError):
    """A usage or environment problem: ``parallelx.exit_on_error`` prints it as one line, exit status 2."""


@dataclass(frozen=True, kw_only=True)
class Case:
    """One measured configuration: a model at a batch size for a number of steps."""

    model: str
    batch: int  # images per process per step
    image_size: int
    warmup: int  # steps run but not timed (first-step allocations, DDP bucket set-up)
    steps: int
    lr: float
    seed: int = 0
    save_weights: bool = False
    threads: int | None = None  # torch threads for this case (default: the plan's)

    @property
    def id(self) -> str:
        return f"{self.model}-{self.image_size}px-b{self.batch}" + (f"-t{self.threads}" if self.threads else "")

    @property
    def classes(self) -> int:
        return MODELS[self.model]["classes"]


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What one launch runs: every case in order, in every process."""

    impl: str  # e.g. "raw-ddp", "px-horovod"
    nproc: int  # expected world size: a launcher that starts fewer is an error
    threads: int  # torch threads per process
    out: str  # directory for the result files
    cases: list[Case] = field(default_factory=list)
    bind_cores: bool = False  # pin each process to its own cores (see apply_threads)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        raw = json.loads(Path(path).read_text())
        return cls(**{**raw, "cases": [Case(**c) for c in raw["cases"]]})

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))


def worker_args(parser: argparse.ArgumentParser | None = None) -> tuple[argparse.Namespace, Plan]:
    """A worker's command line: ``--plan FILE`` and the worker's own options."""
    p = parser or argparse.ArgumentParser()
    p.add_argument("--plan", required=True, help="plan file written by benchmarks.run (--work-dir keeps them)")
    try:  # the deepspeed launcher appends --local_rank=N (parallelx's and DeepSpeed's options may declare it)
        p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    except argparse.ArgumentError:
        pass
    args = p.parse_args()
    return args, Plan.load(args.plan)


def cpu_cores() -> int:
    """Cores this process may run on (the affinity mask, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if HAS_AFFINITY else (os.cpu_count() or 1)


def apply_threads(plan: Plan, case: Case | None = None, *, local_rank: int = 0) -> list[int] | None:
    """Set torch's threads to the plan's (or the case's) count: frameworks treat OMP_NUM_THREADS differently.
    With ``plan.bind_cores``, pin local rank r to the r-th block of t cores (unpinned, threads migrate and
    each lockstep all-reduce waits for the rank slowed most); returns those cores, None when unpinned."""
    threads = case.threads if case is not None and case.threads else plan.threads
    torch.set_num_threads(threads)
    if not plan.bind_cores or _STARTED_ON is None:
        return None
    block = _STARTED_ON[local_rank * threads : (local_rank + 1) * threads]
    if len(block) < threads:
        return None  # fewer cores than processes x threads: nothing sensible to pin
    os.sched_setaffinity(0, block)
    return block


def build_model(case: Case) -> nn.Module:
    """The recipes' model, seeded just before construction: the same initial weights in every worker."""
    from recipes.models import LeNet, check_vgg_image_size, vgg16_for_dogcat

    torch.manual_seed(case.seed)
    if case.model == "lenet":
        return LeNet(num_classes=case.classes)
    check_vgg_image_size(case.image_size)
    return vgg16_for_dogcat(num_classes=case.classes)


def make_optimizer(model: nn.Module, case: Case) -> torch.optim.Optimizer:
    # Momentum, so that a backend that changed the update would show in the weights; no weight decay,
    # because Horovod's broadcast_optimizer_state() takes a zero-gradient step that it would turn into an update.
    return torch.optim.SGD(model.parameters(), lr=case.lr, momentum=0.9)


def synthetic_batches(case: Case, rank: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``POOL`` batches for ``rank`` already on ``device``, so that the step time is the step alone; a
    private generator leaves torch's global random state alone."""
    out = []
    for i in range(POOL):
        g = torch.Generator().manual_seed(case.seed * 1_000_003 + i * 1009 + rank)
        x = torch.randn(case.batch, 3, case.image_size, case.image_size, generator=g)
        out.append((x.to(device), torch.randint(0, case.classes, (case.batch,), generator=g).to(device)))
    return out


def seed_steps(case: Case, rank: int) -> None:
    """Seed right before the first step: VGG16's dropout then draws the same masks whatever set-up consumed."""
    torch.manual_seed(case.seed + 7919 * (rank + 1))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(
    case: Case,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    times: list[float],
    first: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``warmup + steps`` batches from index ``first`` on; each timed loop body's time goes to ``times``."""
    for i in range(case.warmup + case.steps):
        start = time.perf_counter()
        yield batches[(first + i) % len(batches)]
        synchronize(device)
        if i >= case.warmup:
            times.append(time.perf_counter() - start)


def torch_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> Step:
    """The step as PyTorch's DDP tutorial and Horovod's guide write it."""

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    return train_step


def result_path(out: str | os.PathLike[str], impl: str, case: Case, rank: int) -> Path:
    return Path(out) / f"{impl}.{case.id}.rank{rank}.json"


def weights_path(out: str | os.PathLike[str], impl: str, case: Case) -> Path:
    return Path(out) / f"{impl}.{case.id}.weights.pt"


def check_world_size(plan: Plan, world_size: int) -> None:
    """Before measuring: a launcher that started the wrong number of processes is an error."""
    if world_size != plan.nproc:
        raise BenchError(
            f"{plan.impl}: the launcher started {world_size} processes, the plan expects {plan.nproc}; "
            "check the launcher's process-count flag"
        )


def rank_report(
    plan: Plan, case: Case, rank: int, world_size: int, device: torch.device, loss: torch.Tensor | None, **extra: Any
) -> dict[str, Any]:
    """The figures every worker's result file holds, plus the worker's own."""
    return {
        "impl": plan.impl,
        "case": asdict(case),
        "case_id": case.id,
        "rank": rank,
        "world_size": world_size,
        "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cores": sorted(os.sched_getaffinity(0)) if HAS_AFFINITY else None,
        "device": str(device),
        # Peak resident memory so far (Linux reports KiB).
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_gpu_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
        "final_loss": None if loss is None else float(loss.detach().float().cpu()),
        **extra,
    }


def run_plan(
    plan: Plan,
    prepare: Callable[[Case], tuple[Step, nn.Module]],
    *,
    rank: int,
    local_rank: int,
    world_size: int,
    device: torch.device,
    state_dict: Callable[[nn.Module], dict[str, torch.Tensor]] | None = None,
) -> None:
    """Measure every case of ``plan``: ``prepare(case)`` builds the worker's own step and model, the rest is
    the same for every worker.  Every rank calls ``state_dict(model)`` (on sharding backends a collective)."""
    check_world_size(plan, world_size)
    Path(plan.out).mkdir(parents=True, exist_ok=True)
    for case in plan.cases:
        apply_threads(plan, case, local_rank=local_rank)
        train_step, model = prepare(case)
        batches = synthetic_batches(case, rank, device)
        seed_steps(case, rank)
        times: list[float] = []
        for x, y in timed_steps(case, batches, device, times):
            loss = train_step(x, y)
        weights = (state_dict or nn.Module.state_dict)(model) if case.save_weights else None
        report = rank_report(plan, case, rank, world_size, device, loss, step_times_s=times)
        result_path(plan.out, plan.impl, case, rank).write_text(json.dumps(report))
        if weights is not None and rank == 0:
            torch.save({k: v.detach().to("cpu") for k, v in weights.items()}, weights_path(plan.out, plan.impl, case))
        del train_step, model, batches, weights
        release(device)


def release(device: torch.device) -> None:
    """Free what one case left behind before the next one is measured."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
