"""One launch, many checks: run under torchrun, horovodrun or the deepspeed
launcher (or plain python for single/dp) and write ``rank<N>.json`` with what
each rank saw.  ``tests/test_distributed.py`` asserts on those files.

    torchrun --nproc-per-node 2 tests/dist_worker.py --backend ddp --out DIR
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
import parallelx.backend as pxb
from parallelx import MetricSums, real_mask
from parallelx.cli import exit_on_error

GLOBAL_BATCH = 16
STEPS = 3
DATASET_SIZE = 23  # not divisible by 2 or 4: the sampler must pad


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # Momentum and weight decay: a backend that silently changes the update
    # (an extra step, a different averaging) shows up in the weights.
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(STEPS, GLOBAL_BATCH, 8, generator=g), torch.randint(0, 4, (STEPS, GLOBAL_BATCH), generator=g)


def reference_weights() -> dict[str, torch.Tensor]:
    """One process trained on the whole global batch."""
    model = make_model()
    opt = make_optimizer(model)
    xs, ys = global_batch()
    for s in range(STEPS):
        loss = nn.functional.cross_entropy(model(xs[s]), ys[s])
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@exit_on_error
def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--zero-stage", type=int, default=None)
    p.add_argument("--scenario", choices=["checks", "raise", "stall"], default="checks")
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None)  # the deepspeed launcher's
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    options = {} if args.timeout is None else {"timeout": args.timeout}
    if args.zero_stage is not None:
        options["zero_stage"] = args.zero_stage
    backend = parallelx.get_backend(args.backend, **options)
    backend.init()
    r, w = backend.rank, backend.world_size
    report: dict = {"rank": r, "world_size": w, "device": str(backend.device), "name": backend.name,
                    "detected": parallelx.detect_backend(), "local_rank": backend.local_rank}

    if args.scenario == "raise":
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

    # 2. three SGD steps on a global batch split across ranks == one process on all of it
    base = make_model()
    model, optimizer = backend.setup(base, make_optimizer(base))
    xs, ys = global_batch()
    per_rank = GLOBAL_BATCH // w
    for s in range(STEPS):
        x = xs[s, r * per_rank:(r + 1) * per_rank].to(backend.device)
        y = ys[s, r * per_rank:(r + 1) * per_rank].to(backend.device)
        loss = nn.functional.cross_entropy(model(x), y)
        backend.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    ref = reference_weights()
    mine = backend.model_state_dict(model)
    rel = max(float((mine[k] - ref[k]).abs().max() / ref[k].abs().max()) for k in ref)
    report["max_rel_err_vs_single"] = rel
    flat = torch.cat([v.flatten().double() for v in mine.values()])
    spread = backend.all_reduce(flat, op="max") - backend.all_reduce(flat, op="min")
    report["param_spread_across_ranks"] = float(spread.abs().max())

    # 3. save called by every rank -> one file
    ckpt_dir = out / "ckpt"
    backend.save({"model": model, "optimizer": optimizer, "step": STEPS}, ckpt_dir / "state.pth")
    backend.save(model, ckpt_dir / "model.pth")
    report["ckpt_files_seen"] = sorted(os.listdir(ckpt_dir))
    loaded = backend.load(ckpt_dir / "state.pth")
    report["ckpt_step"] = loaded["step"]
    report["ckpt_matches_ref"] = max(float((loaded["model"][k] - ref[k]).abs().max()) for k in ref)

    # 4. sampler: shards per epoch, with no set_epoch call
    data = list(range(DATASET_SIZE))
    sampler = backend.make_sampler(data, shuffle=True, seed=1)
    report["sampler"] = {"epoch0": list(iter(sampler)), "epoch1": list(iter(sampler)),
                         "num_real": sampler.num_real, "len": len(sampler)}

    # 5. exact metrics over a padded eval shard
    eval_sampler = backend.make_sampler(data, shuffle=False)
    sums = MetricSums()
    idx = torch.tensor(list(iter(eval_sampler)), dtype=torch.float64)
    for start in range(0, len(idx), 5):  # batches of 5
        chunk = idx[start:start + 5]
        sums.update(chunk, chunk.long() % 2 == 0, real_mask(eval_sampler, start, len(chunk)))
    report["metrics"] = sums.compute(backend)

    # 6. the last collective's handle outlives this function (see parallelx.backend._RECENT_WORK)
    backend.barrier()
    held = list(pxb._RECENT_WORK)
    report["last_work_held"] = bool(held) and all(w.is_completed() for w in held)
    (out / f"rank{r}.json").write_text(json.dumps(report))
    backend.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
