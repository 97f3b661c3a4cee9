"""Optimizer state keyed by parameter name, loaded through ``backend.load_state_dict``: run under
torchrun, horovodrun or the deepspeed launcher with 2 processes (a section of ``core_worker``);
each rank writes ``rank<N>.json`` for ``tests/launcher/test_trainstate_launch.py``.

    torchrun --nproc-per-node 2 tests/support/optstate_worker.py --backend fsdp --out DIR

A model with a tied weight and an AdamW with two parameter groups trains 3 steps; its state,
gathered whole by position (``backend.optimizer_state_dict``), goes into a plain copy of the
optimizer, from which torch's own ``get_optimizer_state_dict`` makes the name-keyed form (a tied
weight once, under its first name).  Fresh models then load the position-keyed state, torch's
name-keyed one and parallelx's own (``backend.named_optimizer_state``, as in ``state.pt``): the
loaded states and the weights after 2 more steps must be equal to the bit.  A name the model does
not have, a shape of another model and another group layout must each be a ParallelxError
naming the key, on every rank.  ``tests/unit/test_state_by_name.py`` runs :func:`check` in-process.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

import parallelx
from parallelx import ParallelxError

VOCAB, DIM, BATCH = 11, 6, 4


class Tied(nn.Module):
    """An embedding whose weight the output layer shares (as GPT-2's), so the model's
    ``named_parameters()`` holds ``emb.weight`` and not ``out.weight``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mid = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.out = nn.Linear(DIM, VOCAB, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(torch.tanh(self.mid(self.emb(x)))))


def groups(module: nn.Module) -> list[dict[str, Any]]:
    """Two groups: the tied weight, the bias and the norm at one rate, the hidden weight at another."""
    return [
        {"params": [module.emb.weight, module.mid.bias, *module.norm.parameters()]},
        {"params": [module.mid.weight], "lr": 3e-3, "weight_decay": 0.0},
    ]


def build(backend: parallelx.Backend, seed: int, *, setup: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``setup``: the optimizer built on the plain model, then ``backend.setup(model, optimizer)``
    (fsdp moves it onto its sharded parameters), instead of on the wrapped model's."""
    torch.manual_seed(seed)
    if setup:
        plain = Tied()
        model, optimizer = backend.setup(plain, torch.optim.AdamW(groups(plain), lr=1e-2, weight_decay=0.1))
        assert optimizer is not None
        return model, optimizer
    model = backend.wrap_model(Tied())
    optimizer = backend.wrap_optimizer(torch.optim.AdamW(groups(backend.unwrap(model)), lr=1e-2, weight_decay=0.1))
    return model, optimizer


def train(backend: parallelx.Backend, model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * backend.rank + step)
        x = torch.randint(0, VOCAB, (BATCH,), generator=g).to(backend.device)
        y = torch.randint(0, VOCAB, (BATCH,), generator=g).to(backend.device)
        loss = nn.functional.cross_entropy(model(x), y)
        backend.backward(loss)
        backend.step(optimizer)


def torch_named(positional: dict[str, Any]) -> dict[str, Any]:
    """The name-keyed form torch's ``get_optimizer_state_dict`` writes, of the same state: loaded by
    position into a plain copy of the optimizer, then asked of torch."""
    plain = Tied()
    optimizer = torch.optim.AdamW(groups(plain), lr=1e-2, weight_decay=0.1)
    optimizer.load_state_dict(copy.deepcopy(positional))
    return get_optimizer_state_dict(plain, optimizer)


def same(a: Any, b: Any) -> bool:
    """Equal to the bit, tensors included (a nested state dict)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def refusal(backend: parallelx.Backend, state: dict[str, Any]) -> str:
    """The ParallelxError of loading ``state`` into a fresh model's optimizer ('' if it loaded)."""
    model, optimizer = build(backend, 5)
    try:
        backend.load_state_dict(optimizer, state)
    except ParallelxError as exc:
        return str(exc)
    return ""


def check(backend: parallelx.Backend) -> dict[str, Any]:
    model, optimizer = build(backend, 0)
    train(backend, model, optimizer, 3)
    weights = backend.model_state_dict(model)
    positional = backend.optimizer_state_dict(optimizer)
    assert positional is not None
    forms = {
        "position": positional,
        "torch": torch_named(positional),
        "parallelx": backend.named_optimizer_state(model, optimizer),
    }
    loaded, after = {}, {}
    for seed, (form, state) in enumerate(forms.items(), start=1):
        # The name-keyed forms into an optimizer that went through backend.setup (torch's, the FSDP2
        # example's --dcp-api resume), the positional one into one wrapped after its model.
        fresh, fresh_optimizer = build(backend, seed, setup=form != "position")
        backend.load_state_dict(fresh, weights)
        # A copy: torch.optim's load_state_dict keeps the very tensors it is given where their
        # device and type fit, and the steps below would change this dict's.
        backend.load_state_dict(fresh_optimizer, copy.deepcopy(state))
        loaded[form] = backend.optimizer_state_dict(fresh_optimizer)
        train(backend, fresh, fresh_optimizer, 2)
        after[form] = backend.model_state_dict(fresh)
    train(backend, model, optimizer, 2)
    named = forms["torch"]
    renamed = {**named, "state": {("emb.wieght" if k == "emb.weight" else k): v for k, v in named["state"].items()}}
    reshaped = {**named, "state": {**named["state"], "mid.weight": {**named["state"]["mid.weight"]}}}
    reshaped["state"]["mid.weight"]["exp_avg"] = torch.zeros(DIM, DIM + 1)
    merged = {
        **named,
        "param_groups": [
            {**named["param_groups"][0], "params": [p for g in named["param_groups"] for p in g["params"]]}
        ],
    }
    return {
        "rank": backend.rank,
        "world_size": backend.world_size,
        "torch_keys": sorted(named["state"]),
        "loaded_equal": {form: same(loaded[form], loaded["position"]) for form in loaded},
        "loaded_is_saved": same(loaded["position"], positional),
        "after_equal": {form: same(after[form], after["position"]) for form in after},
        "continues_run": same(after["position"], backend.model_state_dict(model)),
        "refused": {
            "name": refusal(backend, renamed),
            "shape": refusal(backend, reshaped),
            "groups": refusal(backend, merged),
        },
    }


def main() -> int:
    p = argparse.ArgumentParser()
    parallelx.add_arguments(p)
    p.add_argument("--out", required=True, type=Path)
    args, _ = p.parse_known_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with parallelx.from_args(args) as backend:
        report = check(backend)
        (args.out / f"rank{backend.rank}.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
