"""One launch, every gathering and synchronised-BatchNorm check: run under
torchrun, horovodrun or the deepspeed launcher with 2 processes; each rank
writes ``rank<N>.json`` with what it saw, and ``tests/test_gather_launch.py``
asserts on those files.

    torchrun --nproc-per-node 2 tests/gather_worker.py --backend ddp --out DIR

The BatchNorm check trains nothing: it compares each rank's output, input
gradient and (summed) parameter gradients with one process on the
concatenated batch, and a step through the wrapped model checks that the
converted layers work under the backend's own wrapper.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import parallelx
from parallelx import ParallelxError

DATASET_SIZE = 23  # odd: the sampler pads one duplicate
ROWS = (5, 3)  # each rank's share of the BatchNorm batch: uneven on purpose


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 4 * 4, 5), nn.BatchNorm1d(5))


def bn_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    # A mean far from 0 beside the spread: where float32 sums of squares would cancel.
    return torch.randn(sum(ROWS), 3, 6, 6, generator=g) * 3 + 5, torch.randn(sum(ROWS), 5, generator=g)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def error_of(fn: Any) -> str | None:
    try:
        fn()
    except ParallelxError as exc:
        return str(exc)
    return None


def gathering(backend: parallelx.Backend) -> dict[str, Any]:
    r, w = backend.rank, backend.world_size
    rep: dict[str, Any] = {}
    # Rank r sends r + 1 rows of the value r.
    mine = torch.full((r + 1, 2), float(r))
    rep["uneven"] = backend.all_gather(mine).tolist()
    rep["scalar"] = backend.all_gather(torch.tensor(10 + r)).tolist()
    rep["bool"] = backend.all_gather(torch.tensor([r == 0, True])).tolist()
    empty = torch.zeros((0 if r == 0 else 2, 3))
    rep["some_empty"] = list(backend.all_gather(empty).shape)
    odd = torch.zeros(2, dtype=torch.float32 if r == 0 else torch.float64)
    rep["dtype_error"] = error_of(lambda: backend.all_gather(odd))
    rep["shape_error"] = error_of(lambda: backend.all_gather(torch.zeros(2, 3 + r)))
    rep["objects"] = backend.all_gather_object({"rank": r, "text": "x" * (100 * r + 1), "tuple": (r, None)})

    # gather_in_order: per-sample rows computed from the samples themselves
    # (value i -> row [i, 2i]), shuffled, padded: must come back as arange.
    values = torch.arange(DATASET_SIZE, dtype=torch.float32)
    dataset = TensorDataset(values)
    sampler = backend.make_sampler(dataset, shuffle=True, seed=3)
    rep["sampler_padding"] = sampler.num_samples * w - DATASET_SIZE
    for _ in range(2):  # the second epoch's shuffle is the one gathered
        rows = [torch.stack([x, 2 * x], dim=1) for (x,) in DataLoader(dataset, batch_size=4, sampler=sampler)]
    mine_rows = torch.cat(rows)
    rep["shard_values"] = mine_rows[:, 0].tolist()
    rep["in_order"] = backend.gather_in_order(mine_rows, sampler).tolist()
    rep["partial_error"] = error_of(lambda: backend.gather_in_order(mine_rows[: len(mine_rows) - r], sampler))
    torch_sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=w, rank=r)
    rep["sampler_error"] = error_of(lambda: backend.gather_in_order(mine_rows, torch_sampler))  # type: ignore[arg-type]
    return rep


def batchnorm(backend: parallelx.Backend) -> dict[str, Any]:
    r = backend.rank
    x, weights = bn_inputs()
    reference = make_model()
    x_ref = x.clone().requires_grad_()
    out_ref = reference(x_ref)
    (out_ref * weights).sum().backward()

    start = sum(ROWS[:r])
    rows = slice(start, start + ROWS[r])
    model = make_model()
    rep: dict[str, Any] = {}
    try:
        model = backend.sync_batchnorm(model)
    except ParallelxError as exc:
        rep["error"] = str(exc)
        return rep
    rep["converted"] = sorted({type(m).__name__ for m in model.modules()})
    x_mine = x[rows].clone().requires_grad_()
    out = model(x_mine)
    (out * weights[rows]).sum().backward()  # a sum: no per-rank scaling to undo
    rep["out_err"] = max_err(out.detach(), out_ref.detach()[rows])
    rep["grad_x_err"] = max_err(x_mine.grad, x_ref.grad[rows])
    # The parameters' gradients are local: their sum over ranks is the reference's.
    largest = max(float(p.grad.abs().max()) for p in reference.parameters())
    ref_grads = dict(reference.named_parameters())
    rep["grad_param_rel_err"] = max(
        max_err(backend.all_reduce(p.grad, "sum"), ref_grads[name].grad) / largest
        for name, p in model.named_parameters())
    ref_state = reference.state_dict()
    rep["state_keys_same"] = list(model.state_dict()) == list(ref_state)
    rep["running_err"] = max(max_err(v.double(), ref_state[k].double()) for k, v in model.state_dict().items())
    model.eval()
    rep["eval_err"] = max_err(model(x[rows]).detach(), reference.eval()(x[rows]).detach())

    # The converted model under the backend's wrapper: one step, same parameters on every rank.
    model.train()
    wrapped, optimizer = backend.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert optimizer is not None
    loss = (wrapped(x[rows].to(backend.device)) * weights[rows].to(backend.device)).sum()
    backend.backward(loss)
    optimizer.step()
    flat = torch.cat([v.detach().reshape(-1).double().cpu() for v in backend.model_state_dict(wrapped).values()])
    rep["wrapped_step_ok"] = bool(torch.isfinite(flat).all())
    rep["wrapped_state_spread"] = float((backend.all_reduce(flat, "max") - backend.all_reduce(flat, "min")).abs().max())
    return rep


def main() -> int:
    p = argparse.ArgumentParser()
    parallelx.add_arguments(p)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with parallelx.from_args(args) as backend:
        report = {"rank": backend.rank, "world_size": backend.world_size,
                  "gather": gathering(backend), "batchnorm": batchnorm(backend)}
        (out / f"rank{backend.rank}.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
