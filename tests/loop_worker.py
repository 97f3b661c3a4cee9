"""Run under a real launcher (2 processes): the training-loop options against
plain PyTorch in one process on the same global batches.

Each case sets the loop options, sets up a fresh model and optimizer, trains
through ``backend.batches`` / ``backend.autocast`` / ``backend.backward`` /
``backend.step``, and compares with the reference that every rank computes
alone with plain torch.  Every rank writes ``<out>/rank<r>.json`` (errors,
gradient norms, collective counts) and ``<out>/<case>-rank<r>.pt`` (the final
weights, compared across backends by tests/test_loops.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import parallelx  # noqa: E402
from parallelx.errors import ParallelxError  # noqa: E402

B = 4            # samples per rank per micro-batch
FEATURES = 8
LOSS_SCALE = 50.0  # gradient norms in the tens: clipping at 1.0 is active at every step


def model_fn() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, 3))


def global_data(micro_batches: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    n = micro_batches * world * B
    return torch.randn(n, FEATURES, generator=g), torch.randint(0, 3, (n,), generator=g)


def shard(x: torch.Tensor, y: torch.Tensor, rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Micro-batch t of rank r: rows [t*W*B + r*B, t*W*B + (r+1)*B)."""
    out = []
    for start in range(0, len(x), world * B):
        lo = start + rank * B
        out.append((x[lo:lo + B], y[lo:lo + B]))
    return out


def make_optimizer(model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return opt, sched


def criterion(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.float(), y) * LOSS_SCALE


def reference(micro_batches: int, world: int, accumulate: int, clip: float | None,
              dtype: torch.dtype | None) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """One process, the global batch of every micro-step (all ranks' rows), plain torch."""
    model = model_fn()
    opt, sched = make_optimizer(model)
    x, y = global_data(micro_batches, world)
    step_rows = world * B
    norms, lrs = [], []
    windows = [list(range(s, min(s + accumulate, micro_batches))) for s in range(0, micro_batches, accumulate)]
    for window in windows:
        for t in window:
            xs, ys = x[t * step_rows:(t + 1) * step_rows], y[t * step_rows:(t + 1) * step_rows]
            with torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext():
                loss = criterion(model(xs), ys)
            (loss / len(window)).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else float("inf"))
        norms.append(float(norm))
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms, lrs


def rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float() - b[k].float()).norm() / b[k].float().norm()) for k in b)


class CollectiveCounter:
    """Counts gradient reductions started through each backend's Python entry points."""

    def __init__(self, backend_name: str) -> None:
        self.count = 0
        self._undo: list[tuple[Any, str, Any]] = []
        targets: list[tuple[Any, str]] = []
        if backend_name == "horovod":
            import horovod.torch.optimizer as hopt

            targets += [(hopt, "allreduce_async_"), (hopt, "grouped_allreduce_async_")]
        if backend_name == "deepspeed":
            import deepspeed.comm as dscomm

            targets += [(dscomm, n) for n in dir(dscomm) if "reduce" in n and callable(getattr(dscomm, n))
                        and not n.startswith("_") and n[0].islower()]
        import torch.distributed as dist

        targets += [(dist, n) for n in ("all_reduce", "reduce_scatter", "reduce_scatter_tensor",
                                        "all_reduce_coalesced", "_reduce_scatter_base")]
        for mod, name in targets:
            original = getattr(mod, name, None)
            if original is None:
                continue
            self._undo.append((mod, name, original))
            setattr(mod, name, self._wrap(original))

    def _wrap(self, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return fn(*args, **kwargs)
        return counted

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


def train(backend: parallelx.Backend, batches: Any, *, counter: CollectiveCounter | None = None,
          limit: int | None = None) -> dict[str, Any]:
    model = backend.wrap_model(model_fn())
    opt, _ = make_optimizer(model)
    opt = backend.wrap_optimizer(opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    if counter is not None and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model.register_comm_hook(None, counter.ddp_hook())
    norms, lrs, losses, inside, micro = [], [], [], [], 0
    for x, y in backend.batches(batches, limit=limit):
        before = counter.count if counter else 0
        with backend.autocast():
            loss = criterion(model(x.to(backend.device)), y.to(backend.device))
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
    return {"weights": weights, "total": counter.count if counter else 0, "norms": norms, "lrs": lrs,
            "inside": inside, "micro": micro, "losses": losses}


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
                backend.set_options(**{"accumulate": 1, "clip_grad_norm": None, "precision": "32",
                                       "grad_compression": "none", **opts})
            except ParallelxError as exc:
                rep[name] = {"error": str(exc)}
                continue
            x, y = global_data(steps, w)
            counter = CollectiveCounter(backend.name) if name == "accumulate-clip" else None
            try:
                got = train(backend, shard(x, y, r, w), counter=counter)
            finally:
                if counter:
                    counter.close()
            ref, ref_norms, ref_lrs = reference(steps, w, opts.get("accumulate", 1), opts.get("clip_grad_norm"),
                                                dtype)
            torch.save(got["weights"], args.out / f"{name}-rank{r}.pt")
            rep[name] = {
                "rel_err": rel_err(got["weights"], ref),
                "norms": got["norms"], "ref_norms": ref_norms, "lrs": got["lrs"], "ref_lrs": ref_lrs,
                "inside": got["inside"], "total": got["total"], "micro": got["micro"], "losses": got["losses"],
            }
        # Uneven inputs: rank r has 3 + 2r micro-batches, as a list and as a generator (no len()).
        backend.set_options(accumulate=2, clip_grad_norm=None, precision="32", grad_compression="none")
        x, y = global_data(3 + 2 * (w - 1), w)
        mine = shard(x, y, r, w)[:3 + 2 * r]
        rep["uneven-list"] = {"micro": train(backend, mine)["micro"]}
        got = train(backend, (b for b in mine))
        rep["uneven-iterable"] = {"micro": got["micro"], "norms": got["norms"]}
        torch.save(got["weights"], args.out / f"uneven-rank{r}.pt")
        got = train(backend, (b for b in mine), limit=2)
        rep["limit"] = {"micro": got["micro"]}
    (args.out / f"rank{r}.json").write_text(json.dumps(rep))


if __name__ == "__main__":
    main()
