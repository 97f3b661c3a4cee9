"""``single``: one process on one device (``cuda:0`` if present, else the CPU).

python -m recipes.cifar10 --backend single
"""

from __future__ import annotations

from torch import nn

from parallelx.strategies.single_process import LocalBackend


class SingleBackend(LocalBackend):
    name = "single"
    summary = "one device: `cuda:0`, else the CPU"

    def _init(self) -> None:
        self._device = self._pick_device(0)

    def _wrap_model(self, model: nn.Module) -> nn.Module:
        return model.to(self.device)
