"""``dp``: ``torch.nn.DataParallel`` over all visible GPUs, in one process.

    python -m recipes.dogcat --backend dp

DataParallel splits each batch across the GPUs and gathers the outputs on
``cuda:0``; the loss is computed on the whole batch, so the math is that of a
single device.  With fewer than two GPUs it runs exactly like ``single``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from parallelx.backend import Backend, warn


class DataParallelBackend(Backend):
    name = "dp"

    @classmethod
    def detect(cls, environ: Mapping[str, str], argv: Sequence[str]) -> int:
        # No launcher, several GPUs: one process driving all of them.
        return 1 if torch.cuda.is_available() and torch.cuda.device_count() > 1 else 0

    def init(self) -> None:
        self._gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        self._device = torch.device("cuda", 0) if self._gpus else torch.device("cpu")
        if self._gpus < 2 and self.verbose:
            where = "1 GPU" if self._gpus == 1 else "no GPU"
            warn(f"dp: {where} visible, so DataParallel has nothing to split over; running as 'single'")
        self._initialized = True

    def wrap_model(self, model: nn.Module) -> nn.Module:
        self._require_init()
        model = model.to(self.device)
        return nn.DataParallel(model) if self._gpus > 1 else model
