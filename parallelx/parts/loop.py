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
global norm, the optimizer and the scheduler stepped once per window.  The
loop reaches a backend through three of its parts: the gradient
synchronisation (:class:`parallelx.parts.gradsync.GradientSync`: DDP's ``no_sync``,
Horovod's ``synchronize``, DeepSpeed's accumulation boundary), the collectives
(:class:`parallelx.parts.collectives.Collectives`) and the precision
(:class:`parallelx.parts.precision.Precision`).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sized
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from parallelx.errors import ParallelxError
from parallelx.log import warn
from parallelx.parts.collectives import Collectives, Watch
from parallelx.parts.gradsync import GradientSync
from parallelx.parts.precision import Precision

T = TypeVar("T")

PRECISIONS: tuple[str, ...] = ("32", "bf16-mixed", "16-mixed", "bf16-compute")
COMPRESSIONS: tuple[str, ...] = ("none", "fp16", "bf16")


@dataclass(frozen=True)
class LoopOptions:
    """What a backend does to the update, besides averaging over the ranks."""

    #: Micro-batches per optimizer step (gradient accumulation).
    accumulate: int = 1
    #: Clip the averaged gradients to this global 2-norm (None: no clipping).
    clip_grad_norm: float | None = None
    #: ``32``; ``bf16-mixed`` (autocast to bfloat16, CPU and GPU);
    #: ``16-mixed`` (autocast to float16 with loss scaling, GPUs only); ``bf16-compute`` (the
    #: engine gathers and computes on a bfloat16 copy of the weights; float32 weights, update
    #: and gradient averaging: docs/loops.md, "Precision").
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
    def compute_dtype(self) -> torch.dtype | None:
        """The type the backend's engine casts the weights to for the forward and the backward
        (``bf16-compute``); None where the weights stay as they are."""
        return torch.bfloat16 if self.precision == "bf16-compute" else None

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


#: Called at every window's end with the optimizer, once its gradients are the
#: averaged, unscaled ones and before they are clipped.
BoundaryHook = Callable[[torch.optim.Optimizer], None]


class LoopSettings(Protocol):
    """Where a loop reads the options and the precision in force (:class:`parallelx.strategy.Run`)."""

    options: LoopOptions
    precision: Precision


class StepMarks(Protocol):
    """What the loop tells whoever measures it (:class:`parallelx.observability.Monitor`) of where each step is."""

    def pass_start(self) -> None: ...
    def requested(self) -> None: ...
    def ready(self, batch: Any) -> None: ...
    def backward_done(self) -> None: ...
    def step_done(self) -> None: ...
    def pass_end(self) -> None: ...
    def pass_paused(self) -> None: ...


class NoMarks:
    """Nobody measures: every mark does nothing."""

    def pass_start(self) -> None:
        pass

    def requested(self) -> None:
        pass

    def ready(self, batch: Any) -> None:
        pass

    def backward_done(self) -> None:
        pass

    def step_done(self) -> None:
        pass

    def pass_end(self) -> None:
        pass

    def pass_paused(self) -> None:
        pass


class LoopWatcher:
    """Watches the loop from outside (``python -m parallelx check``'s probe is one): each method
    does nothing here.  :meth:`TrainingLoop.add_watcher` attaches one; the loop stays the same object."""

    def view(self, loader: Iterable[Any], limit: int | None) -> tuple[Iterable[Any], int | None, LoopOptions | None]:
        """The loader, limit and options this pass runs with (the check's one-process reference plays its
        N ranks' batches in turn); by default unchanged (None: the options in force)."""
        return loader, limit, None

    def before_backward(self, loss: torch.Tensor) -> None:
        """The loss handed to ``backend.backward``, before anything is done to it."""

    def after_backward(self) -> None:
        """That backward is done."""

    def stepping(self, inside: bool) -> None:
        """``backend.step`` starts (True) or ends (False)."""


class TrainingLoop:
    """The loop's side of a backend: accumulation windows, equal batch counts
    on every rank, the loss divided once per window, and the boundary step,
    through the backend's gradient synchronisation, collectives and precision."""

    def __init__(
        self,
        name: str,
        sync: GradientSync,
        comm: Collectives,
        watch: Watch,
        settings: LoopSettings,
        meter: StepMarks | None = None,
    ) -> None:
        self.name = name
        self.sync = sync
        self.comm = comm
        self.watch = watch
        #: Where the options and the precision in force are held (the run's, shared with its backend).
        self.settings = settings
        self._options: LoopOptions | None = None
        #: Where the current micro-batch sits (SINGLE outside batches()).
        self.window: Window = SINGLE
        self._boundary_hooks: list[BoundaryHook] = []
        self._watchers: list[LoopWatcher] = []
        #: Told where each step is (:class:`parallelx.observability.Monitor`: throughput, profiles, logging intervals).
        self.meter: StepMarks = meter if meter is not None else NoMarks()

    @property
    def options(self) -> LoopOptions:
        """The options in force: the run's, unless a pass set its own (the check's one-process world)."""
        return self._options if self._options is not None else self.settings.options

    @options.setter
    def options(self, options: LoopOptions | None) -> None:
        self._options = None if options is None or options is self.settings.options else options

    @property
    def precision(self) -> Precision:
        return self.settings.precision

    def add_watcher(self, watcher: LoopWatcher) -> None:
        """Tell ``watcher`` of each pass, loss, backward and step (see :class:`LoopWatcher`)."""
        self._watchers.append(watcher)

    def add_boundary_hook(self, hook: BoundaryHook) -> Callable[[], None]:
        """Call ``hook(optimizer)`` at every window's end, between the averaging
        and the clipping (where :meth:`GradientSync.averaged_gradients` is
        valid); returns a function that removes it."""
        self._boundary_hooks.append(hook)
        return lambda: self._boundary_hooks.remove(hook)

    def batches(self, loader: Iterable[T], limit: int | None = None) -> Iterator[T]:
        if limit is not None and limit < 1:
            raise ParallelxError(f"batches(limit=...) must be >= 1, got {limit}")
        for watcher in self._watchers:
            loader, limit, options = watcher.view(loader, limit)
            if options is not None:
                saved, self.options = self._options, options
                try:
                    yield from self._pass(loader, limit)
                finally:
                    if self._options is options:  # (set_options meanwhile wins)
                        self._options = saved
                return
        yield from self._pass(loader, limit)

    def _pass(self, loader: Iterable[T], limit: int | None) -> Iterator[T]:
        n = self._agreed_length(loader, limit)
        size = self.options.accumulate
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
                k = (
                    int(self.comm.all_reduce(torch.tensor([len(window)]), op="min").item())
                    if self.comm.world_size > 1
                    else len(window)
                )
                if k < len(window):
                    warn(
                        f"{self.name}: another rank ran out of batches; this rank stops too (policy: every "
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
        try:
            n = len(loader) if isinstance(loader, Sized) else -1
        except TypeError:  # a DataLoader over an IterableDataset has __len__ but no length
            n = -1
        if n >= 0 and limit is not None:
            n = min(n, limit)
        if self.comm.world_size > 1:
            both = self.comm.all_reduce(torch.tensor([n, -n]), op="max")  # [longest, -shortest] in one collective
            longest, shortest = int(both[0]), -int(both[1])
            if shortest < 0:
                return None
            if shortest != longest:
                warn(
                    f"{self.name}: the ranks' loaders give {shortest} to {longest} batches; every rank takes "
                    f"{shortest} (the rest of the longer shards is left out of this pass)"
                )
            n = shortest
        return None if n < 0 else n

    def _micro_batch(self, batch: T, window: Window) -> Iterator[T]:
        self.window = window
        # Inside a window the forward *and* the backward run under the backend's no-sync.
        with self.sync.no_sync() if not window.boundary else contextlib.nullcontext():
            yield batch
        self.window = SINGLE

    def backward(self, loss: torch.Tensor, model: nn.Module | None = None) -> None:
        for watcher in self._watchers:
            watcher.before_backward(loss)
        try:
            self._backward(loss, model)
        finally:
            for watcher in self._watchers:
                watcher.after_backward()

    def _backward(self, loss: torch.Tensor, model: nn.Module | None) -> None:
        window = self.window
        if self.options.accumulate > 1 and not window.managed:
            raise ParallelxError(
                f"{self.name}: accumulate={self.options.accumulate} needs the loop to run over "
                "backend.batches(loader), which marks the accumulation windows"
            )
        if window.size > 1:
            loss = loss / window.size
        loss = self.precision.scale(loss)
        with self.watch("backward (the gradient all-reduce)"):
            self.sync.backward(loss, model=model, boundary=window.boundary)
        self.meter.backward_done()

    def step(self, optimizer: torch.optim.Optimizer, scheduler: Any = None) -> StepResult | None:
        for watcher in self._watchers:
            watcher.stepping(True)
        try:
            return self._step(optimizer, scheduler)
        finally:
            for watcher in self._watchers:
                watcher.stepping(False)

    def _step(self, optimizer: torch.optim.Optimizer, scheduler: Any) -> StepResult | None:
        if not self.window.boundary:
            return None
        sync = self.sync
        with self.watch("the optimizer step (gradient synchronisation)"):
            sync.synchronize(optimizer)
            self.precision.unscale(optimizer)
            for hook in list(self._boundary_hooks):
                hook(optimizer)
            norm = sync.clip(optimizer, self.options.clip_grad_norm)
            applied = sync.apply(optimizer, self.precision)
            if norm is None:
                norm = sync.stepped_grad_norm(optimizer)
        if scheduler is not None and applied:
            scheduler.step()
        optimizer.zero_grad()
        self.meter.step_done()
        return StepResult(grad_norm=norm.detach(), skipped=not applied)
