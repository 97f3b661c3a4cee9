"""Run under a real launcher (2 processes): a GPT as users train one, on one backend.

The model (``gpt.GPT``) ties its output layer to its token embedding, keeps
its blocks in a ``ModuleList`` inside a ``ModuleDict``, has a frozen
parameter and a trainable one outside every optimizer group; the optimizer is
AdamW with three groups of different hyperparameters.  Sections:

- ``grads``: accumulation 2 and clipping at 1.0, in float32 and in
  bf16-mixed.  At every boundary, the averaged gradients the optimizer is
  about to step with (``backend.grad_sync.averaged_gradients``) against DDP's
  arithmetic from the same weights, computed here on a plain copy of the
  model: each rank sums its window's micro-batches, then the ranks' sums are
  averaged.  Their largest relative difference per tensor, and the reported
  gradient norm against ``clip_grad_norm_`` over the model's parameters (in
  the model's order) on the same averaged gradients.  The final weights go to
  ``<out>/grads-<precision>.pt`` for the comparison across backends.
- ``save``: ``backend.save`` and a training-state checkpoint of that model
  and optimizer, loaded back into a fresh set-up: equal, with plain names.
- ``grid``: the loop grid's options on this model: accumulation (with a
  short last window), clipping, bf16-mixed and a warm-up then cosine
  schedule, against one process on the global batch; the final weights go to
  ``<out>/grid-rank<r>.pt`` for the comparison across backends.
- ``recompute``: the same steps with dropout, with and without activation
  checkpointing (``auto``: the model's blocks): the weights, to the bit.
- ``rank0``: a forward on rank 0 alone, in evaluation mode, while rank 1 runs
  a training forward: a ``ParallelxError`` on both ranks under the backends
  whose forward is a collective, nothing elsewhere.

Every rank writes ``<out>/rank<r>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from gpt import GPT, Config, adamw_groups, tokens

import parallelx
from parallelx.errors import ParallelxError

B = 4  # sequences per rank per micro-batch
STEPS = 3  # optimizer steps
ACCUMULATE = 2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / max(float(b.double().norm()), 1e-30))


def fresh(cfg: Config, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def reference_gradients(
    backend: parallelx.Backend, state: dict[str, torch.Tensor], cfg: Config, micro: list[int], precision: str
) -> dict[str, torch.Tensor]:
    """DDP's arithmetic from the weights ``state``: this rank's window summed
    (each micro-batch's loss divided by the window), then averaged over the ranks."""
    plain = GPT(cfg)
    plain.load_state_dict(state)
    plain.train()
    for t in micro:
        x, y = tokens(backend.rank, t, B, cfg)
        with torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16-mixed" else contextlib.nullcontext():
            _, loss = plain(x, y)
        (loss / len(micro)).backward()
    return {
        n: backend.all_reduce(p.grad, "sum") / backend.world_size
        for n, p in plain.named_parameters()
        if p.grad is not None
    }


def train(
    backend: parallelx.Backend,
    cfg: Config,
    *,
    steps: int = STEPS,
    compare: bool = False,
    precision: str = "32",
) -> dict[str, Any]:
    """Train a fresh GPT for ``steps`` optimizer steps; with ``compare``, check every boundary's gradients."""
    backend.set_options(accumulate=ACCUMULATE, clip_grad_norm=1.0, precision=precision)
    m = fresh(cfg)
    model, optimizer = backend.setup(m, adamw_groups(m))
    assert optimizer is not None
    report: dict[str, Any] = {"grad_rel": [], "norms": [], "ref_norms": []}
    pending: dict[str, Any] = {}

    def at_boundary(opt: torch.optim.Optimizer) -> None:
        got = backend.grad_sync.averaged_gradients(opt)
        ref = reference_gradients(backend, pending["weights"], cfg, pending["micro"], precision)
        report["grad_rel"].append({n: rel(got[n], ref[n]) for n in got})
        # clip_grad_norm_ over the model's parameters in its own order (the trained ones: all are in the optimizer
        # but logit_scale, which it does not step), on the same averaged gradients.
        order = [n for n, p in m.named_parameters() if n in got]
        report["ref_norms"].append(float(torch.nn.utils.get_total_norm([got[n] for n in order])))
        report["names_in_order"] = order

    remove = backend.loop.add_boundary_hook(at_boundary) if compare else None
    batches = [tokens(backend.rank, t, B, cfg) for t in range(steps * ACCUMULATE)]
    for i, (x, y) in enumerate(backend.batches(batches)):
        if compare and i % ACCUMULATE == 0:  # the weights this window starts from (a collective)
            pending["weights"] = backend.model_state_dict(model)
            pending["micro"] = list(range(i, i + ACCUMULATE))
        with backend.autocast():
            _, loss = model(x.to(backend.device), y.to(backend.device))
        backend.backward(loss)
        result = backend.step(optimizer)
        if result is not None:
            report["norms"].append(float(result.grad_norm))
    if remove is not None:
        remove()
    report["weights"] = backend.model_state_dict(model)
    report["model"], report["optimizer"] = model, optimizer
    return report


def section_grads(backend: parallelx.Backend, out: Path, rep: dict[str, Any]) -> None:
    cfg = Config()
    for precision in ("32", "bf16-mixed"):
        got = train(backend, cfg, compare=True, precision=precision)
        torch.save(got["weights"], out / f"grads-{precision}-rank{backend.rank}.pt")
        rep[f"grads-{precision}"] = {
            "grad_rel": got["grad_rel"],
            "worst": max(max(step.values()) for step in got["grad_rel"]),
            "norms": got["norms"],
            "ref_norms": got["ref_norms"],
            "names_in_order": got["names_in_order"],
        }
        if precision == "32":
            section_save(backend, out, rep, got, cfg)


def section_save(backend: parallelx.Backend, out: Path, rep: dict[str, Any], got: dict[str, Any], cfg: Config) -> None:
    """The trained model and its three-group AdamW through backend.save and a training-state checkpoint."""
    model, optimizer = got["model"], got["optimizer"]
    path = out / "portable.pt"
    backend.save({"model": model, "optimizer": optimizer}, path)
    saved = torch.load(path, weights_only=True)
    run_dir = out / "run"
    parallelx.save_training_state(backend, run_dir, step=STEPS, model=model, optimizer=optimizer, counters={"s": 1})
    m = fresh(cfg, seed=1)
    model2, optimizer2 = backend.setup(m, adamw_groups(m))
    info = parallelx.load_training_state(
        backend, parallelx.latest_checkpoint(run_dir), model=model2, optimizer=optimizer2
    )
    named = backend.named_optimizer_state(model2, optimizer2)
    loaded = backend.model_state_dict(model2)
    plain = GPT(cfg)
    plain.load_state_dict(saved["model"])  # the portable file loads into the plain model
    rep["save"] = {
        "keys": sorted(saved["model"]),
        "weights_equal": all(torch.equal(loaded[k], got["weights"][k]) for k in loaded),
        "portable_equal": all(torch.equal(saved["model"][k], got["weights"][k]) for k in saved["model"]),
        "groups": [
            {k: v for k, v in g.items() if k in ("lr", "weight_decay")} for g in saved["optimizer"]["param_groups"]
        ],
        "state_entries": len(saved["optimizer"]["state"]),
        "named_state_entries": len(named["state"]),
        "exp_avg_keys": sorted(named["state"])[:3],
        "counters": info["counters"],
    }


def section_recompute(backend: parallelx.Backend, out: Path, rep: dict[str, Any]) -> None:
    cfg = Config(dropout=0.1)
    plain = train(backend, cfg)["weights"]
    backend.run.activation_checkpointing = True
    try:
        checkpointed = train(backend, cfg)["weights"]
    finally:
        backend.run.activation_checkpointing = None
    rep["recompute"] = {
        "equal": all(torch.equal(plain[k], checkpointed[k]) for k in plain),
        "worst": max(rel(checkpointed[k], plain[k]) for k in plain),
    }


def section_rank0(backend: parallelx.Backend, out: Path, rep: dict[str, Any]) -> None:
    cfg = Config()
    m = fresh(cfg)
    model, _ = backend.setup(m, adamw_groups(m))
    x, y = tokens(backend.rank, 0, B, cfg)
    started = time.monotonic()
    error = None
    try:
        if backend.rank == 0:  # a script's `if master_process: estimate_loss()`
            model.eval()
            with torch.no_grad():
                model(x, y)
        else:
            model.train()
            model(x, y)
    except ParallelxError as exc:
        error = str(exc)
    rep["rank0"] = {"error": error, "seconds": time.monotonic() - started}
    if error is None:
        backend.barrier()


#: The loop grid's options on the GPT: (accumulate, precision, clip), each with a warm-up then cosine schedule.
GRID = [(1, "32", None), (3, "32", 0.5), (1, "bf16-mixed", 0.5), (3, "bf16-mixed", None)]
GRID_MICRO = 7  # micro-batches: with accumulate 3, windows of 3, 3 and a short last one of 1


def schedule(optimizer: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A linear warm-up over 2 steps, then cosine to 0."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / 2 if s < 2 else 0.5 * (1 + math.cos(math.pi * (s - 2) / max(1, steps - 2)))
    )


def grid_reference(world: int, accumulate: int, precision: str, clip: float | None, cfg: Config) -> dict[str, Any]:
    """One process on the global batches (every rank's micro-batch t together), plain torch."""
    model = fresh(cfg)
    optimizer = adamw_groups(model)
    steps = -(-GRID_MICRO // accumulate)
    scheduler = schedule(optimizer, steps)
    trained = [
        p for n, p in model.named_parameters() if any(p is q for g in optimizer.param_groups for q in g["params"])
    ]
    norms = []
    for start in range(0, GRID_MICRO, accumulate):
        window = range(start, min(start + accumulate, GRID_MICRO))
        for t in window:
            xs, ys = zip(*(tokens(r, t, B, cfg) for r in range(world)))
            with torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16-mixed" else contextlib.nullcontext():
                _, loss = model(torch.cat(xs), torch.cat(ys))
            (loss / len(window)).backward()
        norm = torch.nn.utils.clip_grad_norm_(trained, clip if clip else float("inf"))
        norms.append(float(norm))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()}, "norms": norms}


def section_grid(backend: parallelx.Backend, out: Path, rep: dict[str, Any]) -> None:
    """The loop grid's options (accumulation with a short last window, clipping, bf16, a schedule) on the GPT
    with AdamW groups and tied weights, against one process on the global batch."""
    cfg = Config(bias=False)  # nanoGPT's: no attention key bias, whose zero gradient is pure rounding noise
    grid: dict[str, Any] = {}
    weights: dict[str, dict[str, torch.Tensor]] = {}
    for accumulate, precision, clip in GRID:
        name = f"accumulate={accumulate} {precision} clip={clip}"
        backend.set_options(accumulate=accumulate, clip_grad_norm=clip, precision=precision)
        m = fresh(cfg)
        model, optimizer = backend.setup(m, adamw_groups(m))
        assert optimizer is not None
        steps = -(-GRID_MICRO // accumulate)
        scheduler = schedule(optimizer, steps)
        norms = []
        for x, y in backend.batches([tokens(backend.rank, t, B, cfg) for t in range(GRID_MICRO)]):
            with backend.autocast():
                _, loss = model(x.to(backend.device), y.to(backend.device))
            backend.backward(loss)
            result = backend.step(optimizer, scheduler)
            if result is not None:
                norms.append(float(result.grad_norm))
        got = backend.model_state_dict(model)
        ref = grid_reference(backend.world_size, accumulate, precision, clip, cfg)
        weights[name] = got
        grid[name] = {
            "rel_err": max(rel(got[k], ref["weights"][k]) for k in got),
            "norms": norms,
            "ref_norms": ref["norms"],
            "steps": steps,
            "precision": precision,
            "accumulate": accumulate,
        }
    rep["grid"] = grid
    torch.save(weights, out / f"grid-rank{backend.rank}.pt")


SECTIONS = {"grads": section_grads, "grid": section_grid, "recompute": section_recompute, "rank0": section_rank0}


def main() -> None:
    p = argparse.ArgumentParser()
    parallelx.add_arguments(p)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    backend = parallelx.from_args(args)
    rep: dict[str, Any] = {}
    with backend:
        rep.update(rank=backend.rank, world_size=backend.world_size)
        for name, section in SECTIONS.items():
            try:
                section(backend, args.out, rep)
            except Exception as exc:  # reported, so that one failure does not hide the others
                rep[f"{name}-error"] = f"{type(exc).__name__}: {exc}"
                if isinstance(exc, ParallelxError) or "not found in optimizer state" in str(exc):
                    continue
                raise
        backend.set_options(accumulate=1, clip_grad_norm=None, precision="32")
    (args.out / f"rank{backend.rank}.json").write_text(json.dumps(rep, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
