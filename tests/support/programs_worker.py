"""Run under a real launcher (2 processes): programs with several models,
optimizers and backward passes, against plain PyTorch arithmetic computed in
this same process.

Every case sets up fresh models on the backend and trains them through
``backend.backward`` / ``backend.step``; the reference is the same program in
plain PyTorch on one process over the global batch.  Where a model holds
BatchNorm, the reference runs each rank's half of the batch through it
separately and averages the halves' losses: what DDP computes (BatchNorm's
statistics are per rank without SyncBatchNorm), and what one process
computes for the other layers.

- ``one_param``: a one-parameter model at 0, two backward passes (inputs 1.5
  and 3.0) then one SGD step at lr 1: -4.5, closed form.
- ``mlp``: a small MLP, two backward passes per step (two batches), SGD with
  momentum, 3 steps.
- ``gan``: a DCGAN-shaped step (Lightning Fabric's example, tiny): G and D
  with BatchNorm, two Adam optimizers; D on a real and a detached fake batch
  (two backward calls), then G's loss through D (D's parameters get
  gradients, which the script zeroes before D's next step, as in plain
  PyTorch: ``d.zero_grad()`` and ``opt_d.zero_grad()`` in turn); 3 steps,
  the weights of both models.
- ``teacher``: a frozen teacher (``requires_grad=False``, eval, no optimizer,
  ``backend.setup(teacher)``) beside a trained student: the student against
  plain PyTorch, the teacher unchanged, no teacher parameter in the optimizer
  state.
- ``two_optimizers``: one loss through models a and b, ``step(opt_a)`` then
  ``step(opt_b)``: b's gradients survive a's step (b's weights against
  plain PyTorch).
- ``plain_loop``: ``optimizer.step()`` and ``optimizer.zero_grad()`` by hand
  after two ``backend.backward`` calls.

Every rank writes ``<out>/rank<r>.json``: per case the largest relative
error against the reference (``rel_err``, per tensor), extra checks, or the
``ParallelxError`` it raised (``error``).
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import torch
from torch import nn
from worker_cases import Case, run_cases

import parallelx

B = 4  # rows per rank
STEPS = 3


def rel_err(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """The largest relative L2 difference per floating-point tensor of ``state`` from ``ref``."""
    errs = [
        float((state[k].double() - v.double()).norm() / max(float(v.double().norm()), 1e-30))
        for k, v in ref.items()
        if v.is_floating_point()
    ]
    return max(errs)


def params_of(backend: parallelx.Backend, model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters, whole, on the CPU (a collective where they are sharded)."""
    names = {n for n, _ in backend.unwrap(model).named_parameters()}
    return {k: v for k, v in backend.model_state_dict(model).items() if k in names}


def plain_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def batch(step: int, world: int, *shape: int, seed: int = 0) -> torch.Tensor:
    """The global batch of ``step`` (world * B rows), the same on every rank."""
    g = torch.Generator().manual_seed(1000 * seed + step)
    return torch.randn(world * B, *shape, generator=g)


def mine(backend: parallelx.Backend, t: torch.Tensor) -> torch.Tensor:
    return t[backend.rank * B : (backend.rank + 1) * B].to(backend.device)


def halves(world: int, t: torch.Tensor) -> list[torch.Tensor]:
    return list(t.split(B))


def mlp(seed: int, n_in: int = 4, n_out: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(n_in, 8), nn.Tanh(), nn.Linear(8, n_out))


# ------------------------------------------------------------------ the cases
def one_param(backend: parallelx.Backend) -> dict[str, Any]:
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    model, opt = backend.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
    assert opt is not None
    for x in (1.5, 3.0):
        backend.backward(model(torch.tensor([[x]], device=backend.device)).sum())
    backend.step(opt)
    return {"value": float(params_of(backend, model)["weight"].item()), "expected": -4.5}


def two_backward_mlp(backend: parallelx.Backend) -> dict[str, Any]:
    world = backend.world_size
    ref = mlp(1)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    model, opt = backend.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert opt is not None
    loss_fn = nn.MSELoss()
    for step in range(STEPS):
        xs = [batch(step, world, 4, seed=s) for s in (1, 2)]
        ys = [batch(step, world, 1, seed=s) for s in (3, 4)]
        for x, y in zip(xs, ys):
            backend.backward(loss_fn(model(mine(backend, x)), mine(backend, y)))
        backend.step(opt)
        for x, y in zip(xs, ys):
            parts = [loss_fn(ref(a), b) for a, b in zip(halves(world, x), halves(world, y))]
            (sum(parts) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"rel_err": rel_err(params_of(backend, model), plain_params(ref))}


NZ = 3  # the generator's noise width
NX = 6  # a "image"'s width


# As in DCGAN, no bias before a BatchNorm: its gradient is exactly zero in arithmetic, rounding
# noise in floats, which Adam turns into steps of the learning rate's size in any summation order.
def generator() -> nn.Module:
    return nn.Sequential(nn.Linear(NZ, 8, bias=False), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, NX), nn.Tanh())


def discriminator() -> nn.Module:
    return nn.Sequential(nn.Linear(NX, 8, bias=False), nn.BatchNorm1d(8), nn.LeakyReLU(0.2), nn.Linear(8, 1))


def gan(backend: parallelx.Backend) -> dict[str, Any]:
    world = backend.world_size
    torch.manual_seed(5)
    ref_g, ref_d = generator(), discriminator()
    g, d = copy.deepcopy(ref_g), copy.deepcopy(ref_d)

    def adam(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(m.parameters(), lr=2e-3, betas=(0.5, 0.999))

    ref_opt_g, ref_opt_d = adam(ref_g), adam(ref_d)
    g, opt_g = backend.setup(g, adam(g))
    d, opt_d = backend.setup(d, adam(d))
    assert opt_g is not None and opt_d is not None
    bce = nn.BCEWithLogitsLoss()

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, 1, device=backend.device)

    def zeros(n: int) -> torch.Tensor:
        return torch.zeros(n, 1, device=backend.device)

    for step in range(STEPS):
        real, noise = batch(step, world, NX, seed=6), batch(step, world, NZ, seed=7)
        # parallelx: D on real and on a detached fake (two backward calls), then G through D.
        # G's previous backward reached D's parameters: zeroed through the module (as Fabric's
        # DCGAN does) or through the optimizer, in turn.
        if step % 2:
            opt_d.zero_grad()
        else:
            d.zero_grad()
        fake = g(mine(backend, noise))
        backend.backward(bce(d(mine(backend, real)), ones(B)))
        backend.backward(bce(d(fake.detach()), zeros(B)))
        backend.step(opt_d)
        backend.backward(bce(d(fake), ones(B)))
        backend.step(opt_g)
        # The same program in plain PyTorch, each rank's half through the BatchNorms on its own.
        ref_opt_d.zero_grad()
        fakes = [ref_g(z) for z in halves(world, noise)]
        (sum(bce(ref_d(r), torch.ones(B, 1)) for r in halves(world, real)) / world).backward()
        (sum(bce(ref_d(f.detach()), torch.zeros(B, 1)) for f in fakes) / world).backward()
        ref_opt_d.step()
        ref_opt_d.zero_grad()
        (sum(bce(ref_d(f), torch.ones(B, 1)) for f in fakes) / world).backward()
        ref_opt_g.step()
        ref_opt_g.zero_grad()
    return {
        "rel_err_g": rel_err(params_of(backend, g), plain_params(ref_g)),
        "rel_err_d": rel_err(params_of(backend, d), plain_params(ref_d)),
    }


def teacher(backend: parallelx.Backend) -> dict[str, Any]:
    world = backend.world_size
    torch.manual_seed(8)
    teach = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    for p in teach.parameters():
        p.requires_grad_(False)
    teach.eval()
    before = plain_params(teach)
    ref_t = copy.deepcopy(teach)
    ref = mlp(9, 4, 4)
    student = copy.deepcopy(ref)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    teach_w, _ = backend.setup(teach)
    student, opt = backend.setup(student, torch.optim.Adam(student.parameters(), lr=1e-2))
    assert opt is not None
    loss_fn = nn.MSELoss()
    for step in range(STEPS):
        x = batch(step, world, 4, seed=10)
        with torch.no_grad():
            target = teach_w(mine(backend, x))
        backend.backward(loss_fn(student(mine(backend, x)), target))
        backend.step(opt)
        parts = [loss_fn(ref(a), ref_t(a)) for a in halves(world, x)]
        (sum(parts) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    state = backend.optimizer_state_dict(opt)
    assert state is not None
    n_state = len(state["state"])
    n_group = sum(len(group["params"]) for group in state["param_groups"])
    return {
        "rel_err": rel_err(params_of(backend, student), plain_params(ref)),
        "teacher_err": rel_err(params_of(backend, teach_w), before),
        "optimizer_entries": [n_state, n_group],
        "student_params": len(list(ref.parameters())),
    }


def two_optimizers(backend: parallelx.Backend) -> dict[str, Any]:
    world = backend.world_size
    ref_a, ref_b = mlp(11), mlp(12)
    a, b = copy.deepcopy(ref_a), copy.deepcopy(ref_b)
    ref_opt_a = torch.optim.SGD(ref_a.parameters(), lr=0.1)
    ref_opt_b = torch.optim.SGD(ref_b.parameters(), lr=0.1, momentum=0.9)
    a, opt_a = backend.setup(a, torch.optim.SGD(a.parameters(), lr=0.1))
    b, opt_b = backend.setup(b, torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9))
    assert opt_a is not None and opt_b is not None
    loss_fn = nn.MSELoss()
    for step in range(STEPS):
        x, y = batch(step, world, 4, seed=13), batch(step, world, 1, seed=14)
        xm = mine(backend, x)
        backend.backward(loss_fn(a(xm) + b(xm), mine(backend, y)))
        backend.step(opt_a)  # b's gradients stay
        backend.step(opt_b)
        parts = [loss_fn(ref_a(u) + ref_b(u), v) for u, v in zip(halves(world, x), halves(world, y))]
        (sum(parts) / world).backward()
        ref_opt_a.step()
        ref_opt_a.zero_grad()
        ref_opt_b.step()
        ref_opt_b.zero_grad()
    return {
        "rel_err_a": rel_err(params_of(backend, a), plain_params(ref_a)),
        "rel_err_b": rel_err(params_of(backend, b), plain_params(ref_b)),
    }


def plain_loop(backend: parallelx.Backend) -> dict[str, Any]:
    """``backend.backward(loss); optimizer.step(); optimizer.zero_grad()`` by hand, two backward calls each."""
    world = backend.world_size
    ref = mlp(15)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model, opt = backend.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert opt is not None
    loss_fn = nn.MSELoss()
    for step in range(STEPS):
        xs = [batch(step, world, 4, seed=s) for s in (16, 17)]
        y = batch(step, world, 1, seed=18)
        for x in xs:
            backend.backward(loss_fn(model(mine(backend, x)), mine(backend, y)))
            (sum(loss_fn(ref(u), v) for u, v in zip(halves(world, x), halves(world, y))) / world).backward()
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"rel_err": rel_err(params_of(backend, model), plain_params(ref))}


CASES: dict[str, Case] = {
    "one_param": lambda b, out: one_param(b),
    "mlp": lambda b, out: two_backward_mlp(b),
    "gan": lambda b, out: gan(b),
    "teacher": lambda b, out: teacher(b),
    "two_optimizers": lambda b, out: two_optimizers(b),
    "plain_loop": lambda b, out: plain_loop(b),
}


def main() -> int:
    return run_cases("programs_worker", CASES, refusals_reported=True)


if __name__ == "__main__":
    sys.exit(parallelx.exit_on_error(main)())
