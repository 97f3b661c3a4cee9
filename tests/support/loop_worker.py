"""Run under a real launcher (2 processes): the training-loop options against
plain PyTorch in one process on the same global batches.

Each case sets the loop options, sets up a fresh model and optimizer, trains
through ``backend.batches`` / ``backend.autocast`` / ``backend.backward`` /
``backend.step``, and compares with the reference that every rank computes
alone with plain torch.  Every rank writes ``<out>/rank<r>.json`` (errors,
gradient norms, collective counts) and ``<out>/<case>-rank<r>.pt`` (the final
weights, compared across backends by tests/launcher/test_loops.py).

Besides the named cases, a grid (:func:`grid_cases`) crosses clipping
thresholds (binding at every step, at some steps, never), LR warm-ups of
several lengths (one longer than some runs) followed by each schedule of the
recipes (``recipes.common.make_scheduler``), accumulation with a short last
window and both CPU precisions; its final weights go to
``<out>/grid-rank<r>.pt`` (one dict, by case name).  The options meet inside
a backend's step (the clipping coefficient, the LR the optimizer reads, the
window's length), so combinations are compared, not each option alone.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import parallelx
from parallelx.errors import ParallelxError
from recipes.common import make_scheduler

B = 4  # samples per rank per micro-batch
FEATURES = 8
LOSS_SCALE = 50.0  # gradient norms in the tens: clipping at 1.0 is active at every step
LR = 0.05

#: Builds a case's LR scheduler on its (wrapped) optimizer; stepped once per optimizer step.
Schedule = Callable[[torch.optim.Optimizer], Any]


def decaying(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


@dataclass(frozen=True)
class Work:
    """What a case trains on besides the loop options."""

    micro_batches: int
    schedule: Schedule = decaying
    loss_scale: float = LOSS_SCALE
    lr: float = LR
    #: Labels from a fixed linear teacher plus noise instead of random ones:
    #: the model learns, so the gradient norm moves with the step size (and a
    #: clipping threshold can bind at some steps and not at others).
    learnable: bool = False


def model_fn() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, 3))


def global_data(micro_batches: int, world: int, learnable: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    n = micro_batches * world * B
    x = torch.randn(n, FEATURES, generator=g)
    if learnable:
        # Its own generator: the first micro-batches are the same whatever their number.
        teacher = torch.randn(FEATURES, 3, generator=torch.Generator().manual_seed(11))
        noise = torch.randn(n, 3, generator=torch.Generator().manual_seed(13))
        return x, (x @ teacher + 0.5 * noise).argmax(1)
    return x, torch.randint(0, 3, (n,), generator=g)


def shard(x: torch.Tensor, y: torch.Tensor, rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Micro-batch t of rank r: rows [t*W*B + r*B, t*W*B + (r+1)*B)."""
    out = []
    for start in range(0, len(x), world * B):
        lo = start + rank * B
        out.append((x[lo : lo + B], y[lo : lo + B]))
    return out


def make_optimizer(model: nn.Module, lr: float = LR) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-2)


def criterion(out: torch.Tensor, y: torch.Tensor, scale: float = LOSS_SCALE) -> torch.Tensor:
    return nn.functional.cross_entropy(out.float(), y) * scale


def reference(
    work: Work, world: int, accumulate: int, clip: float | None, dtype: torch.dtype | None
) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """One process, the global batch of every micro-step (all ranks' rows), plain torch."""
    model = model_fn()
    opt = make_optimizer(model, work.lr)
    sched = work.schedule(opt)
    micro_batches = work.micro_batches
    x, y = global_data(micro_batches, world, work.learnable)
    step_rows = world * B
    norms, lrs = [], []
    windows = [list(range(s, min(s + accumulate, micro_batches))) for s in range(0, micro_batches, accumulate)]
    for window in windows:
        for t in window:
            xs, ys = x[t * step_rows : (t + 1) * step_rows], y[t * step_rows : (t + 1) * step_rows]
            with torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext():
                loss = criterion(model(xs), ys, work.loss_scale)
            (loss / len(window)).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else float("inf"))
        norms.append(float(norm))
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms, lrs


# ------------------------------------------------------------------ the grid
#: Clipping thresholds by what they do on the grid's work (gradient norms of 5
#: to 20, 7.5 to 8.6 at the first step): ``always`` binds at every step,
#: ``some`` at the first step and not at a later one, ``never`` at none (the
#: clipping code still runs).
GRID_CLIPS: dict[str, float | None] = {"none": None, "always": 0.5, "some": 7.0, "never": 1e3}
#: Warm-up lengths in optimizer steps: 8 spans most of a run of 10 steps and
#: outlasts one of 4.
GRID_WARMUPS = (0, 1, 3, 8)
#: The recipes' schedules after the warm-up; cosine twice (the array has 4 levels).
GRID_SCHEDULES = ("constant", "cosine", "step", "cosine")
#: (accumulate, precision); 3 over 10 micro-batches gives windows of 3, 3, 3 and a short last one of 1.
GRID_WINDOWS = ((1, "32"), (3, "32"), (1, "bf16-mixed"), (3, "bf16-mixed"))
GRID_MICRO_BATCHES = 10
GRID_LOSS_SCALE = 10.0
#: Small enough that bfloat16's rounding stays well inside its tolerance over 10 steps (5.7e-3 of 2e-2).
GRID_LR = 0.02


@dataclass(frozen=True)
class GridCase:
    clip_name: str
    warmup: int
    schedule: str
    accumulate: int
    precision: str

    @property
    def name(self) -> str:
        return (
            f"clip={self.clip_name} warmup={self.warmup} {self.schedule} accumulate={self.accumulate} {self.precision}"
        )

    @property
    def clip(self) -> float | None:
        return GRID_CLIPS[self.clip_name]

    @property
    def options(self) -> dict[str, Any]:
        return {
            "accumulate": self.accumulate,
            "clip_grad_norm": self.clip,
            "precision": self.precision,
            "grad_compression": "none",
        }

    @property
    def dtype(self) -> torch.dtype | None:
        return torch.bfloat16 if self.precision == "bf16-mixed" else None

    @property
    def steps(self) -> int:
        return -(-GRID_MICRO_BATCHES // self.accumulate)

    @property
    def work(self) -> Work:
        steps, warmup, kind = self.steps, self.warmup, self.schedule

        def schedule(opt: torch.optim.Optimizer) -> Any:
            # The recipes' own schedule: linear warm-up, then constant, cosine or step.
            return make_scheduler(opt, kind, steps=steps, warmup_steps=warmup)

        return Work(GRID_MICRO_BATCHES, schedule=schedule, loss_scale=GRID_LOSS_SCALE, lr=GRID_LR, learnable=True)


def grid_cases() -> list[GridCase]:
    """The grid: an orthogonal array of strength 2 over GF(4) on (clip, warm-up,
    schedule, window), so that every pair of values of any two axes comes up
    together (16 cases instead of 256); then the combination the grid was
    made for, with each schedule: clipping that binds, a warm-up of most of
    the run, followed by the schedule's steps (with accumulation: its short
    last window)."""
    clips, double = list(GRID_CLIPS), (0, 2, 3, 1)  # double[k]: k times the generator of GF(4)
    cases = []
    for c, k in itertools.product(range(4), range(4)):
        accumulate, precision = GRID_WINDOWS[k]
        cases.append(GridCase(clips[c], GRID_WARMUPS[c ^ k], GRID_SCHEDULES[c ^ double[k]], accumulate, precision))
    for clip, kind, (warmup, accumulate) in itertools.product(
        ("always", "some"), ("constant", "cosine", "step"), ((8, 1), (3, 3))
    ):
        case = GridCase(clip, warmup, kind, accumulate, "32")
        if case not in cases:
            cases.append(case)
    return cases


def run_grid(backend: parallelx.Backend) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
    """Every grid case against one process: the report and the final weights, by case name."""
    r, w = backend.rank, backend.world_size
    report: dict[str, Any] = {}
    weights: dict[str, dict[str, torch.Tensor]] = {}
    for case in grid_cases():
        backend.set_options(**case.options)
        work = case.work
        x, y = global_data(work.micro_batches, w, work.learnable)
        got = train(backend, shard(x, y, r, w), work=work)
        ref, ref_norms, ref_lrs = reference(work, w, case.accumulate, case.clip, case.dtype)
        weights[case.name] = got["weights"]
        report[case.name] = {
            "rel_err": rel_err(got["weights"], ref),
            "norms": got["norms"],
            "ref_norms": ref_norms,
            "lrs": got["lrs"],
            "ref_lrs": ref_lrs,
            "clip": case.clip,
            "clip_name": case.clip_name,
            "precision": case.precision,
            "accumulate": case.accumulate,
            "warmup": case.warmup,
            "steps": case.steps,
        }
    return report, weights


def rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float() - b[k].float()).norm() / b[k].float().norm()) for k in b)


class CollectiveCounter:
    """Counts gradient reductions started through each backend's Python entry points."""

    def __init__(self, backend_name: str, backend: Any = None) -> None:
        self.backend = backend
        self.count = 0
        self._undo: list[tuple[Any, str, Any]] = []
        targets: list[tuple[Any, str]] = []
        if backend_name == "horovod":
            import horovod.torch.optimizer as hopt

            targets += [(hopt, "allreduce_async_"), (hopt, "grouped_allreduce_async_")]
        if backend_name == "deepspeed":
            import deepspeed.comm as dscomm

            targets += [
                (dscomm, n)
                for n in dir(dscomm)
                if "reduce" in n and callable(getattr(dscomm, n)) and not n.startswith("_") and n[0].islower()
            ]
        import torch.distributed as dist

        targets += [
            (dist, n)
            for n in (
                "all_reduce",
                "reduce_scatter",
                "reduce_scatter_tensor",
                "all_reduce_coalesced",
                "_reduce_scatter_base",
            )
        ]
        for mod, name in targets:
            original = getattr(mod, name, None)
            if original is None:
                continue
            self._undo.append((mod, name, original))
            setattr(mod, name, self._wrap(original))

    def _wrap(self, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            # Not parallelx's lockstep check (before a forward that gathers parameters): it
            # exchanges two integers per forward over a group of its own, no gradients.
            if kwargs.get("group") is None or kwargs["group"] is not self.ignored_group():
                self.count += 1
            return fn(*args, **kwargs)

        return counted

    def ignored_group(self) -> Any:
        lockstep = getattr(getattr(self.backend, "strategy", None), "lockstep", None)
        return None if lockstep is None else lockstep.group

    def ddp_hook(self) -> Any:
        """A DDP communication hook: DDP's own all-reduce, counted.  (No
        annotations: DDP checks them, and they are strings in this module.)"""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        def hook(state, bucket):  # type: ignore[no-untyped-def]
            self.count += 1
            return default_hooks.allreduce_hook(state, bucket)

        return hook

    def close(self) -> None:
        for mod, name, original in self._undo:
            setattr(mod, name, original)


def train(
    backend: parallelx.Backend,
    batches: Any,
    *,
    counter: CollectiveCounter | None = None,
    limit: int | None = None,
    work: Work = Work(0),
) -> dict[str, Any]:
    """Train a fresh model on ``batches`` (``work``'s LR, schedule and loss
    scale; its micro-batch count is the loader's)."""
    model = backend.wrap_model(model_fn())
    opt = backend.wrap_optimizer(make_optimizer(model, work.lr))
    sched = work.schedule(opt)
    if counter is not None and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model.register_comm_hook(None, counter.ddp_hook())
    norms, lrs, losses, inside, micro = [], [], [], [], 0
    for x, y in backend.batches(batches, limit=limit):
        before = counter.count if counter else 0
        with backend.autocast():
            loss = criterion(model(x.to(backend.device)), y.to(backend.device), work.loss_scale)
        backend.backward(loss)
        losses.append(float(loss))
        micro += 1
        result = backend.step(opt, sched)
        if result is None:
            inside.append(counter.count - before if counter else 0)  # reductions inside a window
        else:
            norms.append(float(result.grad_norm))
            lrs.append(opt.param_groups[0]["lr"])
    weights = backend.model_state_dict(model)
    return {
        "weights": weights,
        "total": counter.count if counter else 0,
        "norms": norms,
        "lrs": lrs,
        "inside": inside,
        "micro": micro,
        "losses": losses,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    parallelx.add_arguments(p)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    backend = parallelx.from_args(args)
    rep: dict[str, Any] = {}
    with backend:
        r, w = backend.rank, backend.world_size
        rep.update(rank=r, world_size=w)
        # DeepSpeed's ZeRO-3 set-up runs gc.collect() for every engine; with the
        # objects of the imports frozen out of the collector's sight it takes a
        # tenth of the time, which the grid's many set-ups add up.
        gc.freeze()
        cases = {
            # name: (micro-batches, options, reference dtype)
            "accumulate-clip": (7, dict(accumulate=3, clip_grad_norm=1.0), None),
            "plain": (4, dict(), None),
            "clip-only": (4, dict(clip_grad_norm=1.0), None),
            "bf16-mixed": (5, dict(accumulate=2, precision="bf16-mixed"), torch.bfloat16),
            "fp16-wire": (4, dict(grad_compression="fp16"), None),
            "bf16-wire": (4, dict(grad_compression="bf16"), None),
        }
        for name, (steps, opts, dtype) in cases.items():
            try:
                backend.set_options(
                    **{"accumulate": 1, "clip_grad_norm": None, "precision": "32", "grad_compression": "none", **opts}
                )
            except ParallelxError as exc:
                rep[name] = {"error": str(exc)}
                continue
            x, y = global_data(steps, w)
            counter = CollectiveCounter(backend.name, backend) if name == "accumulate-clip" else None
            try:
                got = train(backend, shard(x, y, r, w), counter=counter)
            finally:
                if counter:
                    counter.close()
            ref, ref_norms, ref_lrs = reference(
                Work(steps), w, opts.get("accumulate", 1), opts.get("clip_grad_norm"), dtype
            )
            torch.save(got["weights"], args.out / f"{name}-rank{r}.pt")
            rep[name] = {
                "rel_err": rel_err(got["weights"], ref),
                "norms": got["norms"],
                "ref_norms": ref_norms,
                "lrs": got["lrs"],
                "ref_lrs": ref_lrs,
                "inside": got["inside"],
                "total": got["total"],
                "micro": got["micro"],
                "losses": got["losses"],
            }
        # Uneven inputs: rank r has 3 + 2r micro-batches, as a list and as a generator (no len()).
        backend.set_options(accumulate=2, clip_grad_norm=None, precision="32", grad_compression="none")
        x, y = global_data(3 + 2 * (w - 1), w)
        mine = shard(x, y, r, w)[: 3 + 2 * r]
        rep["uneven-list"] = {"micro": train(backend, mine)["micro"]}
        got = train(backend, (b for b in mine))
        rep["uneven-iterable"] = {"micro": got["micro"], "norms": got["norms"]}
        torch.save(got["weights"], args.out / f"uneven-rank{r}.pt")
        got = train(backend, (b for b in mine), limit=2)
        rep["limit"] = {"micro": got["micro"]}
        rep["grid"], grid_weights = run_grid(backend)
        torch.save(grid_weights, args.out / f"grid-rank{r}.pt")
    (args.out / f"rank{r}.json").write_text(json.dumps(rep))


if __name__ == "__main__":
    main()
