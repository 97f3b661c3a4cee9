"""Precision: one object per backend, chosen once, for everything the
``precision`` option changes.

``32`` does nothing; ``bf16-mixed`` autocasts the forward and the loss to
bfloat16 (weights and gradients stay float32); ``16-mixed`` autocasts to
float16 and scales the loss with a ``GradScaler``, so that small gradients
survive float16, unscales the gradients before they are clipped, and skips a
step whose gradients overflowed.  A backend whose engine does all of that
itself (DeepSpeed's float16 engine) gives a variant of its own
(``Backend.precision_class``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from parallelx.errors import ParallelxError

DTYPES: dict[str, torch.dtype] = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class Precision:
    """Autocast, loss scale, unscale, the (possibly skipped) step and the scale's state."""

    def __init__(self, precision: str, device: torch.device | None = None) -> None:
        """``device`` None: before the backend knows its device (autocast on the
        CPU, no scaler yet); the backend makes it again once it does."""
        if precision == "16-mixed" and device is not None and device.type != "cuda":
            raise ParallelxError(
                f"precision 16-mixed needs a CUDA GPU (float16 autocast with loss scaling); this "
                f"process runs on {device}: use bf16-mixed on the CPU"
            )
        self.name = precision
        self.device = torch.device("cpu") if device is None else device
        self.dtype: torch.dtype | None = DTYPES.get(precision)
        #: The loss scaler of ``16-mixed`` (None otherwise).
        self.scaler: torch.amp.GradScaler | None = self._make_scaler() if device is not None else None

    def _make_scaler(self) -> torch.amp.GradScaler | None:
        return torch.amp.GradScaler(self.device.type) if self.name == "16-mixed" else None

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """``torch.autocast`` to this precision's dtype on the device (nothing for ``32``)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring the (averaged) gradients back to their true size before clipping."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer; False when the step was skipped (inf/nan under 16-mixed)."""
        if self.scaler is None:
            optimizer.step()
            return True
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler.get_scale() >= before  # the scale backs off exactly when the step was skipped


class EnginePrecision(Precision):
    """For a backend whose engine casts, scales and skips inside its own step:
    only the autocast is parallelx's."""

    def _make_scaler(self) -> torch.amp.GradScaler | None:
        return None
