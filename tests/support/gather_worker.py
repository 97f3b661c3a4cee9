"""One launch, every gathering and synchronised-BatchNorm check: run under
torchrun, horovodrun or the deepspeed launcher with 2 processes; each rank
writes ``rank<N>.json`` with what it saw, and ``tests/launcher/test_gather_launch.py``
asserts on those files.

    torchrun --nproc-per-node 2 tests/support/gather_worker.py --backend ddp --out DIR

The synchronised-BatchNorm check trains nothing: it compares each rank's
output, input gradient and (summed) parameter gradients with one process on
the concatenated batch, and a step through the wrapped model checks that the
converted layers work under the backend's own wrapper.  The buffer check
trains a small ResNet-style model with plain (per-process) BatchNorm, then
compares the distributed validation with a one-process evaluation of the
saved checkpoint, and each rank's running statistics with rank 0's, after
training and after a resume from a training-state checkpoint.
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
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 5), nn.BatchNorm1d(5)
    )


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
        for name, p in model.named_parameters()
    )
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


class Block(nn.Module):
    """A residual block: conv-BN-ReLU-conv-BN plus the input."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c, c, 3, padding=1, bias=False),
            nn.BatchNorm2d(c),
            nn.ReLU(),
            nn.Conv2d(c, c, 3, padding=1, bias=False),
            nn.BatchNorm2d(c),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


def tiny_resnet() -> nn.Module:
    torch.manual_seed(2)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1, bias=False),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        Block(6),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(6, 4),
    )


def bn_data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    # Shifted and scaled inputs: the running statistics move far from their start.
    return TensorDataset(torch.randn(n, 3, 8, 8, generator=g) * 2 + 1, torch.randint(0, 4, (n,), generator=g))


def evaluate(
    model: nn.Module,
    loader: DataLoader,
    sums: parallelx.MetricSums,
    device: torch.device,
    backend: parallelx.Backend | None = None,
) -> dict[str, float]:
    """Loss and accuracy over ``loader``: global over the ranks when ``backend`` is given."""
    model.eval()
    with torch.no_grad():
        for x, y in loader:
            out = model(x.to(device)).float()
            y = y.to(device)
            sums.update(nn.functional.cross_entropy(out, y, reduction="none"), out.argmax(1) == y)
    model.train()
    return sums.compute(backend)


def buffer_spread(backend: parallelx.Backend, model: nn.Module) -> float:
    """The largest difference between any rank's buffers and rank 0's."""
    flat = torch.cat([b.detach().double().reshape(-1).cpu() for b in backend.unwrap(model).buffers()])
    return float((backend.all_gather(flat[None]) - backend.broadcast(flat)[None]).abs().max())


def bn_buffers(backend: parallelx.Backend, out: Path) -> dict[str, Any]:
    """Plain BatchNorm, trained on each rank's own shard: the buffer rule makes
    the distributed validation that of the saved checkpoint in one process."""
    train, val = bn_data(44, 3), bn_data(23, 4)  # 23: the validation sampler pads one duplicate
    rep: dict[str, Any] = {}

    def setup() -> tuple[nn.Module, Any, Any, Any]:
        model = tiny_resnet()
        model, opt = backend.setup(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return model, opt, sched, backend.make_sampler(train, shuffle=True, seed=5)

    def validate(model: nn.Module, tag: str) -> None:
        sampler = backend.make_sampler(val, shuffle=False)
        rep[f"{tag}_dist"] = evaluate(
            model,
            DataLoader(val, batch_size=5, sampler=sampler),
            parallelx.MetricSums(sampler),
            backend.device,
            backend,
        )
        rep[f"{tag}_spread"] = buffer_spread(backend, model)
        backend.save({"model": model}, out / f"bn-{tag}.pth")
        saved = tiny_resnet()
        saved.load_state_dict(torch.load(out / f"bn-{tag}.pth", weights_only=True)["model"])
        rep[f"{tag}_one_process"] = evaluate(
            saved, DataLoader(val, batch_size=7), parallelx.MetricSums(), torch.device("cpu")
        )

    model, opt, sched, sampler = setup()
    for _ in range(2):  # the plain loop: optimizer.step() by hand
        for x, y in DataLoader(train, batch_size=4, sampler=sampler):
            loss = nn.functional.cross_entropy(model(x.to(backend.device)).float(), y.to(backend.device))
            backend.backward(loss)
            opt.step()
            opt.zero_grad()
        sched.step()
    validate(model, "trained")
    parallelx.save_training_state(
        backend,
        out / "bn-run",
        step=1,
        model=model,
        optimizer=opt,
        scheduler=sched,
        sampler=sampler,
        counters={"epoch": 2},
    )

    model, opt, sched, sampler = setup()
    parallelx.load_training_state(
        backend,
        parallelx.latest_checkpoint(out / "bn-run"),
        model=model,
        optimizer=opt,
        scheduler=sched,
        sampler=sampler,
    )
    rep["loaded_spread"] = buffer_spread(backend, model)
    for x, y in backend.batches(DataLoader(train, batch_size=4, sampler=sampler)):  # the loop through backend.step
        loss = nn.functional.cross_entropy(model(x.to(backend.device)).float(), y.to(backend.device))
        backend.backward(loss)
        backend.step(opt, sched)
    validate(model, "resumed")
    rep["cost"] = buffer_cost(backend)
    return rep


def buffer_cost(backend: parallelx.Backend) -> dict[str, float]:
    """What the rule costs: torchvision's ResNet-18 (9,620 buffer values in 60
    tensors), a training step at 8 images of 64 px per rank with and without
    the broadcast of rank 0's buffers after it (milliseconds, median of 5)."""
    import statistics
    import time

    from torchvision.models import resnet18

    from parallelx.transforms.buffers import sync_buffers

    model = resnet18(num_classes=10)
    wrapped, opt = backend.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    x, y = torch.randn(8, 3, 64, 64).to(backend.device), torch.randint(0, 10, (8,)).to(backend.device)

    def step() -> None:
        backend.backward(nn.functional.cross_entropy(wrapped(x), y))
        opt.step()  # the hook broadcasts the buffers here
        opt.zero_grad()

    step()
    with_sync, alone = [], []
    for _ in range(5):
        t = time.perf_counter()
        step()
        with_sync.append(time.perf_counter() - t)
        backend.barrier()
        t = time.perf_counter()
        sync_buffers([backend.unwrap(wrapped)], lambda b: backend.broadcast(b, src=0))
        alone.append(time.perf_counter() - t)
        backend.barrier()
    return {"step_ms": 1e3 * statistics.median(with_sync), "sync_ms": 1e3 * statistics.median(alone)}


def main() -> int:
    p = argparse.ArgumentParser()
    parallelx.add_arguments(p)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with parallelx.from_args(args) as backend:
        report = {
            "rank": backend.rank,
            "world_size": backend.world_size,
            "gather": gathering(backend),
            "batchnorm": batchnorm(backend),
            "buffers": bn_buffers(backend, out),
        }
        (out / f"rank{backend.rank}.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
