"""``single``: one process on one device (``cuda:0`` if present, else the CPU).

python -m recipes.cifar10 --backend single
"""

from __future__ import annotations

from torch import nn

from parallelx.strategies.single_process import SingleProcessStrategy
from parallelx.strategy import BackendSpec

from ._compute_copy import compute_copy
from ._moe import refuse_expert_layers


class SingleStrategy(SingleProcessStrategy):
    spec = BackendSpec(name="single", summary="one device: `cuda:0`, else the CPU")

    def wrap_model(self, model: nn.Module) -> nn.Module:
        refuse_expert_layers(model, self.name)
        model = model.to(self.run.device)
        compute_copy(model, lambda: self.run.options.compute_dtype, self.name, self.run.activation_checkpointing)
        return model
