"""Precision: one object per backend, chosen once, for everything the
``precision`` option changes.

``32`` does nothing; ``bf16-mixed`` autocasts the forward and the loss to
bfloat16 (weights and gradients stay float32); ``16-mixed`` autocasts to
float16 and scales the loss with a ``GradScaler``, so that small gradients
survive float16, unscales the gradients before they are clipped, and skips a
step whose gradients overflowed.  A backend whose engine does all of that
itself (DeepSpeed's float16 engine) gives a variant of its own
(``Backend.precision_class``).  ``bf16-compute`` is no autocast: each
backend's engine computes on a bfloat16 copy of the weights itself
(``LoopOptions.compute_dtype``), so ``autocast()`` does nothing under it and
the first step's check below has nothing to say (``by_autocast`` is False).

A mixed precision reaches the forward only through ``with backend.autocast():``;
a loop that never enters it computes in float32 as under ``32``.  That is
said once, after the first optimizer step (:class:`FirstStepCheck`): entering
``autocast()`` sets a flag, and the first step reads it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from parallelx import log
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
        #: The script has entered :meth:`autocast` (the backend carries it over when it makes the part again).
        self.entered = False

    @property
    def by_autocast(self) -> bool:
        """Whether this precision reaches the forward only through :meth:`autocast` (without it, the
        forward computes in float32); False for ``32`` and where an engine casts the weights itself."""
        return self.dtype is not None

    def _make_scaler(self) -> torch.amp.GradScaler | None:
        return torch.amp.GradScaler(self.device.type) if self.name == "16-mixed" else None

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """``torch.autocast`` to this precision's dtype on the device (nothing for ``32``)."""
        self.entered = True
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
    only the autocast is parallelx's.  Its ``16-mixed`` is the engine's float16
    engine, which holds the weights in float16 itself: the forward is float16's
    with or without :meth:`autocast`."""

    def _make_scaler(self) -> torch.amp.GradScaler | None:
        return None

    @property
    def by_autocast(self) -> bool:
        return self.dtype is not None and self.name != "16-mixed"


def unentered(precision: Precision, models: list[nn.Module], who: str) -> str | None:
    """The warning for a precision that reaches the forward only through ``autocast()`` where no
    forward entered it; None when it was entered, is not autocast's, or the weights are already
    in a 16-bit type (an engine's, or the script's ``model.half()``: the forward is 16-bit anyway)."""
    if precision.entered or not precision.by_autocast:
        return None
    if any(p.dtype in (torch.float16, torch.bfloat16) for m in models for p in m.parameters()):
        return None
    return (
        f"{who}: precision {precision.name} changes the forward only inside `with backend.autocast():`, and no "
        "forward before the first optimizer step ran inside it, so this run computes in float32 as under "
        "precision 32; put the forward and the loss inside `with backend.autocast():` (a torch.autocast of the "
        f"script's own does the same: write backend.autocast() instead, which is torch.autocast to {precision.dtype})"
    )


class FirstStepCheck:
    """Reads once, after the first optimizer step of any optimizer set up, whether a forward entered
    the precision's autocast (:func:`unentered`), and warns if not.  The flag is set by entering
    ``autocast()``; the step hook does nothing after its first call."""

    def __init__(self, who: str, precision: Callable[[], Precision], models: Callable[[], list[nn.Module]]) -> None:
        self.who = who
        self.precision = precision
        self.models = models
        self.done = False

    def watch(self, optimizer: Any) -> None:
        """Check after ``optimizer``'s first step (torch's step post-hook, which every backend's
        optimizer runs), unless an earlier step already did."""
        register = getattr(optimizer, "register_step_post_hook", None)
        if not self.done and callable(register):
            register(self._after_step)

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # torch iterates over the hooks while it calls this one: it cannot remove itself here.
        if self.done:
            return
        self.done = True
        warning = unentered(self.precision(), self.models(), self.who)
        if warning is not None:
            log.warn(warning)
