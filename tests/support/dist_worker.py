"""One launch, many checks: run under torchrun, horovodrun or the deepspeed
launcher (or plain python for single/dp) and write ``rank<N>.json`` with what
each rank saw.  ``tests/launcher/test_distributed.py`` asserts on those files.

    torchrun --nproc-per-node 2 tests/support/dist_worker.py --backend ddp --out DIR

The training checks use the card's protocol as a user writes it: one model
set up with ``backend.setup(model, optimizer)``, a second with the two calls
``wrap_model`` then ``wrap_optimizer``, each with an LR scheduler built on the
returned optimizer, gradients far above norm 1 (a backend that clips by
default shows), momentum and weight decay (one that double-steps or rescales
shows), against one process on the global batches.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

import parallelx
import parallelx.strategies.process_group as pg
from parallelx import MetricSums

GLOBAL_BATCH = 16
STEPS = 5
DATASET_SIZE = 23  # not divisible by 2 or 4: the sampler must pad
LOSS_SCALE = 200.0  # gradient norms in the hundreds


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # Momentum and weight decay: a backend that silently changes the update
    # (an extra step, a different averaging) shows up in the weights.
    return torch.optim.SGD(model.parameters(), lr=2e-3, momentum=0.9, weight_decay=1e-2)


def make_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def global_batches(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(STEPS, GLOBAL_BATCH, 8, generator=g) * 3, torch.randint(0, 4, (STEPS, GLOBAL_BATCH), generator=g)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return LOSS_SCALE * nn.functional.cross_entropy(out, y)


def reference(seed: int) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """One process trained on the whole global batches: (weights, grad norms, lrs)."""
    model = make_model(seed)
    opt = make_optimizer(model)
    sched = make_scheduler(opt)
    xs, ys = global_batches(seed)
    norms, lrs = [], []
    for s in range(STEPS):
        loss_fn(model(xs[s]), ys[s]).backward()
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms, lrs


def rel_err(mine: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max(float((mine[k] - ref[k]).abs().max() / ref[k].abs().max()) for k in ref)


def main() -> int:
    p = argparse.ArgumentParser()
    parallelx.add_arguments(p)
    p.add_argument("--out", required=True)
    p.add_argument("--scenario", choices=["checks", "raise", "stall"], default="checks")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    backend = parallelx.from_args(args)
    backend.init()
    r, w = backend.rank, backend.world_size
    report: dict = {
        "rank": r,
        "world_size": w,
        "device": str(backend.device),
        "name": backend.name,
        "detected": parallelx.detect_backend(),
        "local_rank": backend.local_rank,
    }

    if args.scenario == "raise":
        # A model and optimizer are set up (process group, engine, Gloo threads all alive) when rank 1 fails.
        model = make_model()
        model, optimizer = backend.setup(model, make_optimizer(model))
        if r == 1:
            raise RuntimeError("rank 1 fails on purpose")
        backend.all_reduce(torch.ones(1))  # would wait forever for rank 1
        return 0
    if args.scenario == "stall":
        if r == 1:
            time.sleep(120)
        t0 = time.time()
        try:
            backend.all_reduce(torch.ones(1))
        except Exception as exc:
            (out / f"stall{r}.json").write_text(json.dumps({"error": repr(exc)[:500], "waited": time.time() - t0}))
            raise
        return 0

    # 1. collectives
    t = torch.tensor([float(r + 1), 2.0 * r])
    report["all_reduce"] = {op: backend.all_reduce(t, op=op).tolist() for op in ("sum", "mean", "max", "min")}
    report["all_reduce_input_unchanged"] = t.tolist() == [float(r + 1), 2.0 * r]
    report["all_reduce_int_mean"] = backend.all_reduce(torch.tensor([r], dtype=torch.int64), op="mean").tolist()
    report["broadcast_obj"] = backend.broadcast({"from": r}, src=0)
    report["broadcast_tensor"] = backend.broadcast(torch.tensor([float(r) + 5.0]), src=0).tolist()

    # 2. two models, the two forms of the protocol, LR schedulers built after set-up
    base_a, base_b = make_model(0), make_model(1)
    plain_a, plain_b = make_optimizer(base_a), make_optimizer(base_b)
    rng_before = torch.get_rng_state()
    model_a, opt_a = backend.setup(base_a, plain_a)
    model_b = backend.wrap_model(base_b)
    opt_b = backend.wrap_optimizer(plain_b)
    # Set-up draws no random numbers the script would see (the same dropout masks on every backend).
    report["rng_untouched_by_setup"] = torch.equal(torch.get_rng_state(), rng_before)
    report["optimizers_are_torch_optimizers"] = all(isinstance(o, torch.optim.Optimizer) for o in (opt_a, opt_b))
    sched_a, sched_b = make_scheduler(opt_a), make_scheduler(opt_b)
    data = {0: global_batches(0), 1: global_batches(1)}
    per_rank = GLOBAL_BATCH // w
    lrs: dict[str, list[float]] = {"a": [], "b": []}
    for s in range(STEPS):
        for key, model, opt, sched, seed in (("a", model_a, opt_a, sched_a, 0), ("b", model_b, opt_b, sched_b, 1)):
            xs, ys = data[seed]
            x = xs[s, r * per_rank : (r + 1) * per_rank].to(backend.device)
            y = ys[s, r * per_rank : (r + 1) * per_rank].to(backend.device)
            loss = loss_fn(model(x), y)
            # Model a: the backend finds the model itself; model b: named explicitly.
            backend.backward(loss) if key == "a" else backend.backward(loss, model=model)
            opt.step()
            sched.step()
            lrs[key].append(opt.param_groups[0]["lr"])
            opt.zero_grad()
    for key, model, seed in (("a", model_a, 0), ("b", model_b, 1)):
        ref, norms, ref_lrs = reference(seed)
        mine = backend.model_state_dict(model)
        report[f"max_rel_err_vs_single_{key}"] = rel_err(mine, ref)
        report[f"ref_min_grad_norm_{key}"] = min(norms)
        report[f"lrs_{key}"] = lrs[key]
        report[f"ref_lrs_{key}"] = ref_lrs
        flat = torch.cat([v.flatten().double() for v in mine.values()])
        spread = backend.all_reduce(flat, op="max") - backend.all_reduce(flat, op="min")
        report[f"param_spread_across_ranks_{key}"] = float(spread.abs().max())
    ref_a = reference(0)[0]

    # 3. save called by every rank -> one file
    ckpt_dir = out / "ckpt"
    backend.save({"model": model_a, "optimizer": opt_a, "step": STEPS}, ckpt_dir / "state.pth")
    backend.save(model_a, ckpt_dir / "model.pth")
    report["ckpt_files_seen"] = sorted(os.listdir(ckpt_dir))
    loaded = backend.load(ckpt_dir / "state.pth")
    report["ckpt_step"] = loaded["step"]
    report["ckpt_matches_ref"] = max(float((loaded["model"][k] - ref_a[k]).abs().max()) for k in ref_a)

    # 4. sampler: shards per epoch, with no set_epoch call
    items = list(range(DATASET_SIZE))
    sampler = backend.make_sampler(items, shuffle=True, seed=1)
    report["sampler"] = {
        "epoch0": list(iter(sampler)),
        "epoch1": list(iter(sampler)),
        "num_real": sampler.num_real,
        "len": len(sampler),
    }

    # 5. exact metrics over a padded eval shard, no position bookkeeping; two passes, one MetricSums each
    eval_sampler = backend.make_sampler(items, shuffle=False)
    loader = torch.utils.data.DataLoader(
        torch.arange(DATASET_SIZE, dtype=torch.float64), batch_size=5, sampler=eval_sampler
    )
    for _ in range(2):
        sums = MetricSums(eval_sampler)
        for chunk in loader:
            sums.update(chunk, chunk.long() % 2 == 0)
        report["metrics"] = sums.compute(backend)

    # 6. the last collective's handle outlives this function (see parallelx.strategies.process_group._RECENT_WORK)
    backend.barrier()
    held = list(pg._RECENT_WORK)
    report["last_work_held"] = bool(held) and all(work.is_completed() for work in held)
    (out / f"rank{r}.json").write_text(json.dumps(report))
    backend.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(parallelx.exit_on_error(main)())
