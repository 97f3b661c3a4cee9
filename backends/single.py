"""``single``: one process on one device (``cuda:0`` if present, else the CPU).

    python -m recipes.cifar10 --backend single
"""

from __future__ import annotations

import torch
from torch import nn

from parallelx.backend import Backend


class SingleBackend(Backend):
    name = "single"

    def init(self) -> None:
        self._device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        self._initialized = True

    def wrap_model(self, model: nn.Module) -> nn.Module:
        self._require_init()
        return model.to(self.device)
