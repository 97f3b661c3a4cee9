"""The training-loop options shared by every backend, and what a step returns.

A loop written once::

    for x, y in backend.batches(loader):         # windows of `accumulate` micro-batches
        with backend.autocast():                  # `precision`
            loss = criterion(model(x), y)
        backend.backward(loss)                    # scaled once by the window, never all-reduced inside it
        result = backend.step(optimizer, scheduler)   # None inside a window
        if result is not None:
            log(loss.item(), result.grad_norm.item(), result.skipped)

means the same on every backend: one process taking the same global batches,
with the gradients averaged over the window and the ranks, clipped by their
global norm, the optimizer and the scheduler stepped once per window.  How
each backend gets there (DDP's ``no_sync``, Horovod's
``backward_passes_per_step`` and ``synchronize``, DeepSpeed's accumulation
boundary and config) is in the backend's module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .errors import ParallelxError

Precision = Literal["32", "bf16-mixed", "16-mixed"]
PRECISIONS: tuple[str, ...] = ("32", "bf16-mixed", "16-mixed")
Compression = Literal["none", "fp16", "bf16"]
COMPRESSIONS: tuple[str, ...] = ("none", "fp16", "bf16")


@dataclass(frozen=True)
class LoopOptions:
    """What a backend does to the update, besides averaging over the ranks."""

    #: Micro-batches per optimizer step (gradient accumulation).
    accumulate: int = 1
    #: Clip the averaged gradients to this global 2-norm (None: no clipping).
    clip_grad_norm: float | None = None
    #: ``32``; ``bf16-mixed`` (autocast to bfloat16, CPU and GPU);
    #: ``16-mixed`` (autocast to float16 with loss scaling, GPUs only).
    precision: str = "32"
    #: Data type of the gradients on the wire: ``none`` (as computed), ``fp16``, ``bf16``.
    grad_compression: str = "none"

    def __post_init__(self) -> None:
        if isinstance(self.accumulate, bool) or not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise ParallelxError(f"accumulate must be an integer >= 1, got {self.accumulate!r}")
        if self.clip_grad_norm is not None:
            value = float(self.clip_grad_norm)
            if not (value > 0 and math.isfinite(value)):
                raise ParallelxError(f"clip_grad_norm must be a finite number > 0 (or None), got {self.clip_grad_norm}")
            object.__setattr__(self, "clip_grad_norm", value)
        if str(self.precision) not in PRECISIONS:
            raise ParallelxError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        object.__setattr__(self, "precision", str(self.precision))
        if self.grad_compression not in COMPRESSIONS:
            raise ParallelxError(f"grad_compression must be one of {', '.join(COMPRESSIONS)}, "
                                 f"got {self.grad_compression!r}")

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(self.precision)

    @property
    def wire_dtype(self) -> torch.dtype | None:
        return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(self.grad_compression)


@dataclass(frozen=True)
class Window:
    """Where the current micro-batch sits in its accumulation window."""

    position: int = 0
    size: int = 1
    #: True while :meth:`Backend.batches` is handing out this micro-batch.
    managed: bool = False

    @property
    def boundary(self) -> bool:
        """The last micro-batch of its window: gradients are reduced, the optimizer steps."""
        return self.position == self.size - 1


#: Outside :meth:`Backend.batches` every backward is a window of its own.
SINGLE = Window()


@dataclass(frozen=True)
class StepResult:
    """What :meth:`Backend.step` did at the end of a window."""

    #: Global 2-norm of the averaged gradients before clipping (a 0-dim float
    #: tensor on the device, equal on every rank; ``nan`` where the backend
    #: did not compute one).  ``.item()`` waits for the GPU: read it when logging.
    grad_norm: torch.Tensor
    #: True when the update was skipped (an inf/nan gradient under 16-mixed),
    #: on every rank together; the scheduler was not stepped then.
    skipped: bool = False


def total_norm(optimizer: Any) -> torch.Tensor:
    """The global 2-norm of the gradients held by ``optimizer``'s parameters."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(grads, norm_type=2.0)


def clip_to_norm(optimizer: Any, max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients by ``max_norm / (norm + 1e-6)`` when that is below 1,
    exactly as ``torch.nn.utils.clip_grad_norm_`` does."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
