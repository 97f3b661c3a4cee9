"""Which submodules are units (fsdp's sharding, activation checkpointing, per-block compile)."""

from __future__ import annotations

import pytest
from torch import nn

from parallelx.errors import ParallelxError
from parallelx.transforms.units import default_units, select_units


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.fc2(self.fc1(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 10)
        self.emb.weight = self.head.weight  # tied across the root

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def test_the_repeated_blocks_are_the_default_units_innermost_first():
    net = Net()
    assert default_units(net) == [net.blocks[1], net.blocks[0]]


def test_a_tied_weight_keeps_its_modules_out_of_units():
    net = Net()
    with pytest.raises(ParallelxError, match="tied to a module outside it"):
        select_units(net, ["Embedding"], who="fsdp")


def test_an_attentions_out_proj_is_never_a_unit_it_is_read_not_called():
    model = nn.Sequential(nn.Embedding(10, 32), nn.TransformerEncoderLayer(32, 2, 64, batch_first=True))
    units = default_units(model, share=0.01)
    attention = model[1].self_attn
    assert attention.out_proj not in units and units  # other layers still are
    assert attention in select_units(model, ["MultiheadAttention"], who="fsdp")
    with pytest.raises(ParallelxError, match="cannot be a unit"):
        select_units(model, ["NonDynamicallyQuantizableLinear"], who="fsdp")
