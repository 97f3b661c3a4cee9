"""Training checkpoints that plain ``torch.distributed.checkpoint`` code writes, as PyTorch's FSDP2
example does with ``--dcp-api`` (``dcp.save({"model": get_model_state_dict(...), "optim":
get_optimizer_state_dict(...)})``), continued by ``parallelx.load_training_state``: the model's and the
optimizer's state by name, bit for bit, and a step after the load equal to the plain script's next step.
Its non-tensor entries (the param groups) are read strictly (``weights_only``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

import parallelx
from parallelx import ParallelxError


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))


def step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(5, 6, generator=g)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_a_plain_dcp_training_checkpoint_continues_under_parallelx(tmp_path):
    torch.manual_seed(0)
    plain = net()
    opt = torch.optim.AdamW(plain.parameters(), lr=0.01, weight_decay=0.1)
    for s in range(3):
        step(plain, opt, s)
    model_sd, optim_sd = get_state_dict(plain, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    step(plain, opt, 3)  # the plain script's next step

    with parallelx.get_backend("single") as backend:
        torch.manual_seed(1)
        model = net()
        model, optimizer = backend.setup(model, torch.optim.AdamW(model.parameters(), lr=0.5))
        info = parallelx.load_training_state(backend, tmp_path / "ckpt", model=model, optimizer=optimizer)
        assert info["meta"]["format"] == "torch.distributed.checkpoint" and info["counters"] == {}
        assert optimizer.param_groups[0]["lr"] == 0.01  # the saved param groups, not the new optimizer's
        step(model, optimizer, 3)
        got = backend.model_state_dict(model)
    assert all(torch.equal(got[k], v) for k, v in plain.state_dict().items())


class Payload:
    """An object a weights-only read refuses (a pickle could run code)."""


def test_a_folder_without_a_model_or_with_several_parts_is_one_error(tmp_path):
    dcp.save({"weights": {"w": torch.ones(2)}}, checkpoint_id=str(tmp_path / "odd"), no_dist=True)
    with parallelx.get_backend("single") as backend:
        model = net()
        model, optimizer = backend.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(ParallelxError, match="no model state in it"):
            parallelx.load_training_state(backend, tmp_path / "odd", model=model, optimizer=optimizer)
        with pytest.raises(ParallelxError, match="loads into one model and its optimizer"):
            parallelx.load_training_state(backend, tmp_path / "odd", models={"a": model, "b": model})
        state = {"model": dict(model.state_dict()), "optim": {"state": {}, "param_groups": [{"x": Payload()}]}}
        dcp.save(state, checkpoint_id=str(tmp_path / "unsafe"), no_dist=True)
        with pytest.raises(
            ParallelxError, match=r"reading .*unsafe failed \(rank 0: UnpicklingError: Weights only load failed"
        ):
            parallelx.load_training_state(backend, tmp_path / "unsafe", model=model, optimizer=optimizer)
