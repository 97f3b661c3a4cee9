"""DeepSpeed's mixture-of-experts layer on the backends that keep one process (single, dp): refused
at set-up, naming the layer's module path and what to run instead (the launched backends are in
tests/launcher/test_ds_tutorial.py).  A plain torch mixture is not DeepSpeed's layer and sets up."""

from __future__ import annotations

import pytest
from torch import nn

import parallelx
from parallelx import ParallelxError


def with_deepspeed_moe(ep_size: int) -> nn.Module:
    from deepspeed.moe.layer import MoE

    return nn.Sequential(
        nn.Linear(4, 8),
        nn.ModuleDict({"mix": MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=2, ep_size=ep_size)}),
    )


@pytest.mark.parametrize("name", ["single", "dp"])
@pytest.mark.parametrize("ep_size", [1, 2])
def test_deepspeeds_moe_layer_is_refused_at_setup(name, ep_size):
    pytest.importorskip("deepspeed")
    model = with_deepspeed_moe(ep_size)
    with (
        parallelx.get_backend(name, device="cpu") as backend,
        pytest.raises(ParallelxError, match=r"1\.mix is DeepSpeed's mixture-of-experts layer") as err,
    ):
        backend.setup(model)
    assert "--backend deepspeed" in str(err.value) and "plain torch module" in str(err.value)


def test_a_plain_torch_mixture_sets_up():
    class Mixture(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    with parallelx.get_backend("single", device="cpu") as backend:
        backend.setup(nn.Sequential(nn.Linear(4, 8), Mixture()))
