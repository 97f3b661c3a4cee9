"""``--precision bf16-compute`` in one process: ``single`` computes on a bfloat16 copy and steps float32
weights, the first step's autocast check stays silent, and the refusals say what to use instead."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import parallelx
from parallelx.errors import ParallelxError
from parallelx.parts.precision import unentered


def test_single_computes_on_a_bfloat16_copy_and_steps_float32_weights():
    with parallelx.get_backend("single", precision="bf16-compute", device="cpu").init() as backend:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
        model, optimizer = backend.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        seen = []
        net[2].register_forward_pre_hook(lambda m, args: seen.append((m.weight.dtype, args[0].dtype)))
        out = model(torch.randn(3, 4))  # no backend.autocast(): the copy is the engine's, not autocast's
        backend.backward(out.square().mean())
        backend.step(optimizer)
        assert seen == [(torch.bfloat16, torch.bfloat16)] and out.dtype == torch.float32
        assert {p.dtype for p in net.parameters()} == {torch.float32}
        assert all(p.grad is None or p.grad.dtype == torch.float32 for p in net.parameters())
        assert unentered(backend.precision, [net], "single") is None
        assert {t.dtype for t in backend.model_state_dict(model).values()} == {torch.float32}


def test_activation_checkpointing_is_refused_with_the_alternatives():
    backend = parallelx.get_backend("single", precision="bf16-compute", activation_checkpointing=True, device="cpu")
    with backend.init(), pytest.raises(ParallelxError, match="bf16-mixed.*fsdp"):
        backend.setup(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))


def test_deepspeed_refuses_it_and_names_fsdp():
    pytest.importorskip("deepspeed")
    with pytest.raises(ParallelxError, match="fsdp backend with --precision bf16-compute"):
        parallelx.get_backend("deepspeed", precision="bf16-compute")
