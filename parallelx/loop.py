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

import contextlib
import itertools
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from . import precision as amp
from .errors import ParallelxError
from .log import warn

T = TypeVar("T")

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
            raise ParallelxError(
                f"grad_compression must be one of {', '.join(COMPRESSIONS)}, got {self.grad_compression!r}"
            )

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


class LoopHooks:
    """What :class:`TrainingLoop` asks of a backend, with the plain answers:
    ``Backend`` inherits them, and a backend overrides the ones its native
    mechanism does otherwise (DDP's ``no_sync``, Horovod's ``synchronize``,
    DeepSpeed's engine)."""

    options: LoopOptions
    precision: amp.Precision
    device: torch.device
    _initialized: bool

    def _options_changed(self) -> None:
        """Rebuild whatever the backend derived from :attr:`options`."""

    def _check_options(self, options: LoopOptions) -> None:
        """Reject, at construction, loop options this backend cannot honour."""

    def _make_precision(self) -> amp.Precision:
        """The precision for :attr:`options` on :attr:`device`; a backend whose
        engine casts and scales by itself returns a variant."""
        return amp.Precision(self.options.precision, self.device if self._initialized else None)

    def _no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """Keep gradients local for one forward and backward inside a window."""
        return contextlib.nullcontext()

    def _backward(self, loss: torch.Tensor, *, model: nn.Module | None, boundary: bool) -> None:
        loss.backward()

    def _sync_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Make the gradients the averaged ones before they are clipped."""

    def _clip_gradients(self, optimizer: torch.optim.Optimizer, max_norm: float | None) -> torch.Tensor | None:
        """Clip the (averaged) gradients; return their norm before clipping, or
        None when the backend computes it during its step."""
        norm = total_norm(optimizer)
        if max_norm is not None:
            clip_to_norm(optimizer, max_norm, norm)
        return norm

    def _apply_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer; True when the step was skipped (inf/nan under 16-mixed)."""
        return self.precision.step(optimizer)

    def _stepped_grad_norm(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        return torch.tensor(float("nan"))


class TrainingLoop:
    """The loop's side of a backend: accumulation windows, equal batch counts
    on every rank, the loss divided once per window, and the boundary step.

    One per backend (``backend._loop``); what differs between backends is
    reached through the backend's hooks (``_no_sync``, ``_backward``,
    ``_sync_gradients``, ``_clip_gradients``, ``_apply_step``,
    ``_stepped_grad_norm``) and its precision object.
    """

    def __init__(self, backend: Any) -> None:  # a parallelx.Backend (not imported: it imports this module)
        self.backend = backend
        #: Where the current micro-batch sits (SINGLE outside batches()).
        self.window: Window = SINGLE
        #: Told where each step is (parallelx.tracking.Monitor: throughput, profiles, logging intervals).
        self.meter = backend.monitor

    def batches(self, loader: Iterable[T], limit: int | None = None) -> Iterator[T]:
        b = self.backend
        if limit is not None and limit < 1:
            raise ParallelxError(f"batches(limit=...) must be >= 1, got {limit}")
        n = self._agreed_length(loader, limit)
        size = b.options.accumulate
        meter = self.meter
        meter.pass_start()
        iterator = iter(loader)
        try:
            if n is not None:
                for i in range(n):
                    meter.requested()
                    try:
                        batch = next(iterator)
                    except StopIteration:
                        raise ParallelxError(
                            f"the loader ended after {i} batches although its len() is "
                            f"{n}; other ranks may now wait for this one"
                        ) from None
                    start = i - i % size
                    meter.ready(batch)
                    yield from self._micro_batch(batch, Window(i - start, min(size, n - start), managed=True))
                meter.pass_end()
                return
            # Lengths unknown: read a window ahead, then agree on how much of it every rank has.
            seen = 0
            while True:
                want = size if limit is None else min(size, limit - seen)
                meter.requested()
                window = list(itertools.islice(iterator, want))
                k = int(b.all_reduce(torch.tensor([len(window)]), op="min").item()) if b.world_size > 1 else len(window)
                if k < len(window):
                    warn(
                        f"{b.name}: another rank ran out of batches; this rank stops too (policy: every "
                        "rank stops with the shortest, so no collective waits for a rank that has finished)"
                    )
                for j in range(k):
                    meter.ready(window[j])
                    yield from self._micro_batch(window[j], Window(j, k, managed=True))
                seen += k
                if k < want or (limit is not None and seen >= limit):
                    meter.pass_end()
                    return
        finally:
            self.window = SINGLE
            meter.pass_paused()  # left early (a break, an error): no collective here

    def _agreed_length(self, loader: Iterable[Any], limit: int | None) -> int | None:
        """The number of batches every rank takes this pass: the shortest rank's
        ``len(loader)`` (capped by ``limit``), or None when a rank's loader has no length."""
        b = self.backend
        try:
            n = len(loader)  # type: ignore[arg-type]
        except TypeError:
            n = -1
        if n >= 0 and limit is not None:
            n = min(n, limit)
        if b.world_size > 1:
            both = b.all_reduce(torch.tensor([n, -n]), op="max")  # [longest, -shortest] in one collective
            longest, shortest = int(both[0]), -int(both[1])
            if shortest < 0:
                return None
            if shortest != longest:
                warn(
                    f"{b.name}: the ranks' loaders give {shortest} to {longest} batches; every rank takes "
                    f"{shortest} (the rest of the longer shards is left out of this pass)"
                )
            n = shortest
        return None if n < 0 else n

    def _micro_batch(self, batch: T, window: Window) -> Iterator[T]:
        self.window = window
        # Inside a window the forward *and* the backward run under the backend's no-sync.
        with self.backend._no_sync() if not window.boundary else contextlib.nullcontext():
            yield batch
        self.window = SINGLE

    def backward(self, loss: torch.Tensor, model: Any = None) -> None:
        b, window = self.backend, self.window
        if b.options.accumulate > 1 and not window.managed:
            raise ParallelxError(
                f"{b.name}: accumulate={b.options.accumulate} needs the loop to run over "
                "backend.batches(loader), which marks the accumulation windows"
            )
        if window.size > 1:
            loss = loss / window.size
        loss = b.precision.scale(loss)
        with b._watch("backward (the gradient all-reduce)"):
            b._backward(loss, model=model, boundary=window.boundary)
        self.meter.backward_done()

    def step(self, optimizer: torch.optim.Optimizer, scheduler: Any = None) -> StepResult | None:
        b = self.backend
        if not self.window.boundary:
            return None
        with b._watch("the optimizer step (gradient synchronisation)"):
            b._sync_gradients(optimizer)
            b.precision.unscale(optimizer)
            norm = b._clip_gradients(optimizer, b.options.clip_grad_norm)
            skipped = b._apply_step(optimizer)
            if norm is None:
                norm = b._stepped_grad_norm(optimizer)
        if scheduler is not None and not skipped:
            scheduler.step()
        optimizer.zero_grad()
        self.meter.step_done()
        return StepResult(grad_norm=norm.detach(), skipped=skipped)
