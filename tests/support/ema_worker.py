"""Run under a real launcher (2 processes): weight averages, frozen weights and
training-state checkpoints of several objects, against plain PyTorch computed
in this same process (the global batch on one process).

- ``ema``: an MLP trained 6 steps with Adam; ``parallelx.EMA(decay=0.9,
  every=2)`` and a hand-written average (``multi_avg_fn``, every step) beside
  it, against torch's ``AveragedModel(get_ema_multi_avg_fn(0.9))`` and the
  same hand-written function on one process: the averages' weights, a forward
  with them (``ema(x)``), the model's own weights untouched by the swap, the
  elements of the average this rank holds, and the portable file
  (``backend.save(ema.model_state_dict())``) loaded into the plain model.
- ``frozen``: a partly frozen model (a frozen encoder, trainable LoRA-style
  adapters, a frozen head) with Adam, 3 steps, against plain PyTorch; the
  optimizer state (gathered by name) holds the adapters only, the frozen
  weights get no gradient and do not move, and the elements the gradient sync
  reduces in one step (counted at the collectives: DDP's comm hook, torch's
  and DeepSpeed's reduce calls, Horovod's all-reduces) are the trainable ones'
  at most, never the frozen ones'.
- ``gan_resume``: a GAN (G, D, Adam and a StepLR each) with an EMA of G and a
  sampler, in a :class:`parallelx.Checkpointer`: 4 steps straight (A); 2
  steps, saved, new objects resumed from the checkpoint, 2 more (B): A == B
  bitwise for both models, the EMA and both optimizers' states; the
  checkpoint holds the EMA whole.

Every rank writes ``<out>/rank<r>.json``.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from programs_worker import B, batch, discriminator, generator, halves, mine, mlp, params_of, plain_params, rel_err
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from worker_cases import Case, run_cases

import parallelx

DECAY = 0.9


def hand_ema(ema: list[torch.Tensor], current: list[torch.Tensor], n: torch.Tensor) -> None:
    """A user's own average: ``ema = 0.8 * ema + 0.2 * current``, written out."""
    for e, c in zip(ema, current):
        e.mul_(0.8).add_(c, alpha=0.2)


def bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------ ema
def ema_case(backend: parallelx.Backend, out: Path) -> dict[str, Any]:
    world = backend.world_size
    ref = mlp(21, 4, 3)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    ref_avg = AveragedModel(ref, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
    ref_hand = AveragedModel(ref, multi_avg_fn=hand_ema)
    model, opt = backend.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    assert opt is not None
    ema = parallelx.EMA(backend, model, decay=DECAY, every=2)
    hand = parallelx.EMA(backend, model, multi_avg_fn=hand_ema)
    loss_fn = nn.MSELoss()
    for step in range(6):
        x, y = batch(step, world, 4, seed=22), batch(step, world, 3, seed=23)
        backend.backward(loss_fn(model(mine(backend, x)), mine(backend, y)))
        backend.step(opt)
        ema.update()
        hand.update()
        (sum(loss_fn(ref(a), b) for a, b in zip(halves(world, x), halves(world, y))) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if (step + 1) % 2 == 0:
            ref_avg.update_parameters(ref)
        ref_hand.update_parameters(ref)
    before = params_of(backend, model)
    x = batch(99, world, 4, seed=24)
    model.eval()
    got = ema(mine(backend, x)).detach().cpu()
    model.train()
    want = ref_avg(x)[backend.rank * B : (backend.rank + 1) * B].detach()
    after = params_of(backend, model)
    total = sum(p.numel() for p in ref.parameters())
    out.mkdir(parents=True, exist_ok=True)
    path = out / "ema-portable.pt"
    backend.save(ema.model_state_dict(), path)
    plain = mlp(0, 4, 3)
    plain.load_state_dict(torch.load(path, weights_only=True))
    return {
        "rel_err_model": rel_err(params_of(backend, model), plain_params(ref)),
        "rel_err_ema": rel_err(ema.model_state_dict(), ref_avg.module.state_dict()),
        "rel_err_hand": rel_err(hand.model_state_dict(), ref_hand.module.state_dict()),
        "n_averaged": [ema.n_averaged, int(ref_avg.n_averaged)],
        "rel_err_forward": float((got - want).norm() / want.norm()),
        "swap_restored": bitwise(before, after),
        "rel_err_portable": rel_err(plain_params(plain), plain_params(ref_avg.module)),
        "local_numel": sum(t.numel() for t in ema.weights.values()),
        "total_numel": total,
        "sharded": ema.shards.sharded,
    }


# ------------------------------------------------------------------ frozen
class Adapted(nn.Module):
    """A frozen encoder and head with trainable low-rank adapters beside the encoder."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(31)
        self.encoder = nn.Linear(32, 32)
        self.down = nn.Linear(32, 2, bias=False)
        self.up = nn.Linear(2, 32, bias=False)
        self.head = nn.Linear(32, 1)
        for p in [*self.encoder.parameters(), *self.head.parameters()]:
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.encoder(x) + self.up(self.down(x))))


@contextlib.contextmanager
def counting_reductions(model: nn.Module, backend_name: str) -> Iterator[list[int]]:
    """The elements handed to every reducing collective inside the block."""
    counted: list[int] = []
    patches: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, size: Callable[..., int]) -> None:
        real = getattr(owner, name, None)
        if real is None:
            return

        def counting(*args: Any, **kwargs: Any) -> Any:
            counted.append(size(*args, **kwargs))
            return real(*args, **kwargs)

        patches.append((owner, name, real))
        setattr(owner, name, counting)

    def first(*args: Any, **kwargs: Any) -> int:
        t = args[0] if args else next(iter(kwargs.values()))
        return sum(x.numel() for x in t) if isinstance(t, (list, tuple)) else t.numel()

    def second(*args: Any, **kwargs: Any) -> int:  # reduce_scatter(output, input): the input is reduced
        t = args[1] if len(args) > 1 else kwargs.get("input", kwargs.get("input_list"))
        return sum(x.numel() for x in t) if isinstance(t, (list, tuple)) else t.numel()

    import torch.distributed as dist

    patch(dist, "all_reduce", first)
    patch(dist, "all_reduce_coalesced", first)
    patch(dist, "reduce", first)
    patch(dist, "reduce_scatter_tensor", second)
    patch(dist, "reduce_scatter", second)
    patch(dist, "reduce_scatter_single", second)
    with contextlib.suppress(ImportError):
        import deepspeed.comm as dscomm

        for name in ("all_reduce", "inference_all_reduce", "all_reduce_coalesced", "reduce"):
            patch(dscomm, name, first)
        for name in ("reduce_scatter_tensor", "reduce_scatter", "reduce_scatter_fn"):
            patch(dscomm, name, second)
    if backend_name == "horovod":
        import horovod.torch.optimizer as hvd_opt

        patch(hvd_opt, "allreduce_async_", first)
        patch(hvd_opt, "grouped_allreduce_async_", first)
    ddp = model if isinstance(model, nn.parallel.DistributedDataParallel) else None
    if ddp is not None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        # DDP's reducer calls the process group from C++: its buckets go through dist.all_reduce (counted) instead.
        def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads the annotations: none, or real ones
            return allreduce_hook(None, bucket)

        ddp.register_comm_hook(None, hook)
    try:
        yield counted
    finally:
        for owner, name, real in patches:
            setattr(owner, name, real)


def frozen_case(backend: parallelx.Backend, out: Path) -> dict[str, Any]:
    world = backend.world_size
    ref = Adapted()
    model = copy.deepcopy(ref)
    frozen_before = {n: p.detach().clone() for n, p in ref.named_parameters() if not p.requires_grad}
    ref_opt = torch.optim.Adam([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    model, opt = backend.setup(model, torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    assert opt is not None
    loss_fn = nn.MSELoss()
    reduced: list[int] = []
    for step in range(3):
        x, y = batch(step, world, 32, seed=32), batch(step, world, 1, seed=33)
        with counting_reductions(model, backend.name) if step == 1 else contextlib.nullcontext([]) as counted:
            backend.backward(loss_fn(model(mine(backend, x)), mine(backend, y)))
            backend.step(opt)
        reduced += counted
        (sum(loss_fn(ref(a), b) for a, b in zip(halves(world, x), halves(world, y))) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    named = backend.named_optimizer_state(model, opt)
    module = backend.unwrap(model)
    after = params_of(backend, model)
    return {
        "rel_err": rel_err(after, plain_params(ref)),
        "frozen_moved": not bitwise({n: after[n] for n in frozen_before}, frozen_before),
        "frozen_grads": [n for n, p in module.named_parameters() if not p.requires_grad and p.grad is not None],
        "optimizer_state_names": sorted(named["state"]),
        "optimizer_group_names": sorted(n for g in named["param_groups"] for n in g["params"]),
        "trainable_names": sorted(n for n, p in ref.named_parameters() if p.requires_grad),
        "reduced_numel": sum(reduced),
        "reduced": reduced,
        "trainable_numel": sum(p.numel() for p in ref.parameters() if p.requires_grad),
        "frozen_numel": sum(p.numel() for p in ref.parameters() if not p.requires_grad),
    }


# ------------------------------------------------------------------ a GAN with an EMA, resumed
NZ, NX = 3, 6


def gan_run(backend: parallelx.Backend, directory: Path, steps: range, resume: Path | None) -> dict[str, Any]:
    """Fresh G, D, optimizers, schedulers, EMA and sampler; resumed from ``resume`` when given; ``steps`` trained."""
    world = backend.world_size
    torch.manual_seed(41)
    g, d = generator(), discriminator()
    g, g_opt = backend.setup(g, torch.optim.Adam(g.parameters(), lr=2e-3, betas=(0.5, 0.999)))
    d, d_opt = backend.setup(d, torch.optim.Adam(d.parameters(), lr=2e-3, betas=(0.5, 0.999)))
    assert g_opt is not None and d_opt is not None
    g_sched = torch.optim.lr_scheduler.StepLR(g_opt, step_size=1, gamma=0.9)
    d_sched = torch.optim.lr_scheduler.StepLR(d_opt, step_size=2, gamma=0.5)
    ema = parallelx.EMA(backend, g, decay=DECAY)
    sampler = backend.make_sampler(list(range(64)), shuffle=True, seed=3)
    ckpt = parallelx.Checkpointer(
        backend,
        directory,
        g=g,
        d=d,
        g_opt=g_opt,
        d_opt=d_opt,
        g_sched=g_sched,
        d_sched=d_sched,
        ema=ema,
        sampler=sampler,
    )
    ckpt.resume(resume)
    bce = nn.BCEWithLogitsLoss()
    ones, zeros = torch.ones(B, 1, device=backend.device), torch.zeros(B, 1, device=backend.device)
    for step in steps:
        real = mine(backend, batch(step, world, NX, seed=42)) + torch.rand(1).item()  # the RNG resumes too
        fake = g(mine(backend, batch(step, world, NZ, seed=43)))
        d_opt.zero_grad()
        backend.backward(bce(d(real), ones))
        backend.backward(bce(d(fake.detach()), zeros))
        backend.step(d_opt, d_sched)
        backend.backward(bce(d(fake), ones))
        backend.step(g_opt, g_sched)
        ema.update()
        ckpt.global_step += 1
    saved = ckpt.save() if resume is None else None
    return {
        "g": params_of(backend, g),
        "d": params_of(backend, d),
        "ema": ema.state_dict(),
        "g_opt": backend.named_optimizer_state(g, g_opt)["state"],
        "d_opt": backend.named_optimizer_state(d, d_opt)["state"],
        "lr": [g_opt.param_groups[0]["lr"], d_opt.param_groups[0]["lr"]],
        "saved": saved,
        "local_ema_numel": sum(t.numel() for t in ema.weights.values()),
    }


def flat(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return {prefix: state.detach().cpu()}
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in flat(value, f"{prefix}/{key}").items()}
    if isinstance(state, list):
        return {k: v for i, value in enumerate(state) for k, v in flat(value, f"{prefix}/{i}").items()}
    return {prefix: torch.tensor(float(state))} if isinstance(state, (int, float)) else {}


def gan_resume_case(backend: parallelx.Backend, out: Path) -> dict[str, Any]:
    straight = gan_run(backend, out / "straight", range(4), None)
    first = gan_run(backend, out / "resumed", range(2), None)
    assert first["saved"] is not None
    resumed = gan_run(backend, out / "unused", range(2, 4), first["saved"])
    state = torch.load(first["saved"] / "state.pt", weights_only=True)
    saved_ema = state.get("emas", {}).get("ema", {})
    total = sum(p.numel() for p in generator().parameters())
    return {
        "bitwise": {k: bitwise(flat(straight[k]), flat(resumed[k])) for k in ("g", "d", "ema", "g_opt", "d_opt", "lr")},
        "moved": not bitwise(flat(first["ema"]), flat(straight["ema"])),
        "saved_ema_numel": sum(
            v.numel()
            for k, v in saved_ema.items()
            if k.startswith("module.") and "running" not in k and "num_batches" not in k
        ),
        "total_numel": total,
        "local_ema_numel": straight["local_ema_numel"],
    }


CASES: dict[str, Case] = {
    "ema": ema_case,
    "frozen": frozen_case,
    "gan_resume": gan_resume_case,
}


def main() -> int:
    return run_cases("ema_worker", CASES, refusals_reported=True)


if __name__ == "__main__":
    sys.exit(parallelx.exit_on_error(main)())
