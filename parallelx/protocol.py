"""The ``Backend`` protocol: everything a training script asks of a
distributed-training backend, in one place.

A script written against this class runs unchanged on every backend::

    backend = parallelx.get_backend(args.backend)
    with backend:                                  # init(); shutdown() even when training raises
        model = backend.wrap_model(model)
        optimizer = backend.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        sampler = backend.make_sampler(train_set, shuffle=True)
        for x, y in DataLoader(train_set, batch_size=64, sampler=sampler):
            loss = criterion(model(x.to(backend.device)), y.to(backend.device))
            backend.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        backend.save({"model": model, "optimizer": optimizer}, "ckpt.pth")  # on every rank

The class is abstract in everything a multi-process backend must get right
(joining the world, wrapping the model, the collectives), so a new backend
that forgets one fails at class creation, not with silently wrong numbers.
:class:`parallelx.local.LocalBackend` gives the world-of-one answers for the
in-process backends; :class:`parallelx.process_group.ProcessGroupBackend`
implements the collectives over ``torch.distributed``.
"""

from __future__ import annotations

import abc
import argparse
import atexit
import contextlib
import dataclasses
import importlib.util
import itertools
import os
import pickle
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any, ClassVar, Literal, TypeVar

import numpy as np
import torch
from torch import nn

from . import buffers, checkpoint, log
from .errors import ParallelxError
from .launch import PYTHON, Launcher
from .loop import SINGLE, LoopOptions, StepResult, Window, clip_to_norm, total_norm
from .sampler import ShardedSampler
from .watchdog import Watchdog

ReduceOp = Literal["sum", "mean", "max", "min"]
REDUCE_OPS: tuple[str, ...] = ("sum", "mean", "max", "min")
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
T = TypeVar("T")

DEFAULT_TIMEOUT_S = 1800.0


def default_timeout() -> float:
    """Collective timeout in seconds: ``$PARALLELX_TIMEOUT`` or 30 minutes."""
    raw = os.environ.get("PARALLELX_TIMEOUT")
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ParallelxError(f"PARALLELX_TIMEOUT must be a number of seconds, got {raw!r}") from None
    return _check_timeout(value, "PARALLELX_TIMEOUT")


def _check_timeout(value: float, what: str) -> float:
    if not value > 0 or value == float("inf"):  # also rejects nan
        raise ParallelxError(f"{what} must be a finite number of seconds > 0, got {value}")
    return value


def check_op(op: str) -> str:
    if op not in REDUCE_OPS:
        raise ParallelxError(f"unknown reduce op {op!r}; expected one of {', '.join(REDUCE_OPS)}")
    return op


class Backend(abc.ABC):
    """Base class of all backends: one module each under ``backends/``."""

    #: Registry name, e.g. ``"ddp"``.
    name: ClassVar[str] = ""
    #: One line for tables: what runs under this backend.
    summary: ClassVar[str] = ""
    #: How this backend's processes are started (see :mod:`parallelx.launch`).
    launcher: ClassVar[Launcher] = PYTHON
    #: The importable package this backend needs, if any, and how to install it.
    requires_module: ClassVar[str | None] = None
    install_hint: ClassVar[str] = ""
    #: Python code that ``python -m parallelx env`` runs in a fresh process to
    #: check that the package really works; it prints one line of detail.
    probe_code: ClassVar[str | None] = None
    #: True for backends whose collectives can wait forever for a stalled
    #: peer: parallelx then watches their blocking calls (see parallelx.watchdog).
    needs_watchdog: ClassVar[bool] = False

    def __init__(self, *, timeout: float | None = None, device: str | torch.device | None = None,
                 verbose: bool = True, accumulate: int = 1, clip_grad_norm: float | None = None,
                 precision: str = "32", grad_compression: str = "none") -> None:
        #: True when the user chose the timeout (argument or $PARALLELX_TIMEOUT),
        #: which then overrides a launcher's own default.
        self.timeout_explicit = timeout is not None or "PARALLELX_TIMEOUT" in os.environ
        self.timeout_s: float = default_timeout() if timeout is None else _check_timeout(float(timeout), "timeout")
        self.device_request: str = _check_device(device)
        self.verbose = verbose
        self._initialized = False
        self._rank = 0
        self._world_size = 1
        self._local_rank = 0
        self._local_world_size = 1
        self._device = torch.device("cpu")
        #: What the backend does to the update besides averaging (see :mod:`parallelx.loop`).
        self.options = LoopOptions(accumulate=accumulate, clip_grad_norm=clip_grad_norm, precision=precision,
                                   grad_compression=grad_compression)
        self._check_options(self.options)
        self._window: Window = SINGLE
        #: The loss scaler of ``16-mixed`` (None otherwise, or when the backend scales by itself).
        self.grad_scaler: torch.amp.GradScaler | None = None
        self._watchdog: Watchdog | None = None
        self._buffer_sync = buffers.BufferSync(lambda t: self.broadcast(t, src=0))
        self._constructed = True

    # ------------------------------------------------------------------ info
    @property
    def _rank(self) -> int:
        return self.__dict__.get("_rank_value", 0)

    @_rank.setter
    def _rank(self, value: int) -> None:
        # Known from here on: warnings are printed by rank 0 only (see parallelx.log).
        self.__dict__["_rank_value"] = value
        if self.__dict__.get("_constructed"):
            log.set_rank(value)

    @property
    def rank(self) -> int:
        """Global rank of this process among the data-parallel processes."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of data-parallel processes (1 for ``single`` and ``dp``)."""
        return self._world_size

    @property
    def local_rank(self) -> int:
        """Rank of this process on its machine."""
        return self._local_rank

    @property
    def local_world_size(self) -> int:
        """Number of this job's processes on this machine (to share its CPUs)."""
        return self._local_world_size

    @property
    def device(self) -> torch.device:
        """Where this process puts its inputs: ``cuda:<local_rank>`` or ``cpu``."""
        return self._device

    @property
    def initialized(self) -> bool:
        return self._initialized

    def is_main(self) -> bool:
        """True on exactly one process (global rank 0)."""
        return self.rank == 0

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        if self.is_main():
            print(*args, **kwargs, flush=True)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, rank={self.rank}, "
                f"world_size={self.world_size}, device={str(self.device)!r})")

    # --------------------------------------------------------- launch hooks
    @classmethod
    def detect(cls, environ: Mapping[str, str], argv: Sequence[str]) -> int:
        """How strongly the environment says this process was started for this
        backend (0 = not at all).  ``get_backend("auto")`` picks the highest."""
        return 0

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add this backend's own command-line options (called for every
        backend, so a script accepts all of them whichever backend runs)."""

    @classmethod
    def options_from_args(cls, args: argparse.Namespace) -> dict[str, Any]:
        """Constructor options for this backend from parsed command-line args."""
        options: dict[str, Any] = {}
        if getattr(args, "timeout", None) is not None:
            options["timeout"] = args.timeout
        if getattr(args, "device", None) not in (None, "auto"):
            options["device"] = args.device
        for key in ("accumulate", "clip_grad_norm", "precision", "grad_compression"):
            if getattr(args, key, None) is not None:
                options[key] = getattr(args, key)
        return options

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run here, or None when it can.
        Must not import the backend's heavy package (``find_spec`` only looks)."""
        if cls.requires_module is None:
            return None
        try:
            found = importlib.util.find_spec(cls.requires_module) is not None
        except (ImportError, ValueError):
            found = False
        return None if found else f"the {cls.requires_module} package is not installed; {cls.install_hint}"

    # ------------------------------------------------------------ lifecycle
    def init(self) -> Backend:
        """Join the world (if any) and choose the device.  A second call does nothing.
        Returns the backend, so ``backend = get_backend("ddp").init()`` reads well."""
        if self._initialized:
            return self
        with keep_rng_state():
            self._init()
        self._initialized = True
        log.set_rank(self.rank)
        self._limit_cpu_threads()
        if self.options.precision == "16-mixed" and self.device.type != "cuda":
            self._initialized = False
            self._shutdown(failed=True)
            raise ParallelxError(f"{self.name}: precision 16-mixed needs a CUDA GPU (float16 autocast with loss "
                                 f"scaling); this process runs on {self.device}: use bf16-mixed on the CPU")
        self.grad_scaler = self._make_grad_scaler()
        if self.needs_watchdog and self.world_size > 1:
            self._watchdog = Watchdog(self.timeout_s, self.rank)
        # A script that ends without shutdown() (it raised, or forgot) still
        # releases the process group before the interpreter is torn down, while
        # the threads of its communication library can still take the GIL.
        atexit.register(self.abort)
        return self

    @abc.abstractmethod
    def _init(self) -> None:
        """The backend's own start-up: join the process group, then set
        ``_rank``, ``_world_size``, ``_local_rank``, ``_local_world_size`` and
        ``_device``.  Called once, by :meth:`init`."""

    def shutdown(self) -> None:
        """Leave the world and release what the backend holds.  Every rank calls
        it at the end of a successful run.  Safe to call more than once."""
        if self._initialized:
            try:
                with self._watch("shutdown"):
                    self._shutdown(failed=False)
            finally:
                self._initialized = False
                atexit.unregister(self.abort)
                if self._watchdog is not None:
                    self._watchdog.close()

    def abort(self) -> None:
        """Release what this process holds without waiting for the other ranks
        (they may be dead or stuck): for the error path.  Safe to call more than once."""
        if self._initialized:
            try:
                self._shutdown(failed=True)
            except Exception as exc:  # the error that brought us here matters more
                log.warn(f"{self.name}: releasing the backend after a failure raised {type(exc).__name__}: {exc}")
            finally:
                self._initialized = False

    def _shutdown(self, *, failed: bool) -> None:
        """The backend's own tear-down; ``failed`` means: do not talk to other ranks."""

    def _watch(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Arm the watchdog (when this backend needs one) around a blocking call."""
        return self._watchdog.watch(what) if self._watchdog is not None else contextlib.nullcontext()

    def __enter__(self) -> Backend:
        return self.init()

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.shutdown()
        else:
            self.abort()

    def _limit_cpu_threads(self) -> None:
        """On the CPU, give each process on this machine its share of the
        cores: torch's default (all cores in every process) oversubscribes
        them and slows every rank down.  An explicit ``OMP_NUM_THREADS`` from
        the user or the launcher is left alone."""
        if self.device.type == "cpu" and self.local_world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
            from .utils import threads_per_process

            torch.set_num_threads(threads_per_process(self.local_world_size))

    def _require_init(self) -> None:
        if not self._initialized:
            raise ParallelxError(f"backend {self.name!r} is not initialised: call backend.init() "
                                 "(or use `with backend:`) first")

    def _pick_device(self, index: int) -> torch.device:
        """The device for a process that may use GPU ``index``: the user's
        choice (``device="cpu"`` forces the CPU on a GPU machine), else that
        GPU when there is one, else the CPU."""
        if self.device_request == "cpu":
            return torch.device("cpu")
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if index < gpus:
            torch.cuda.set_device(index)
            return torch.device("cuda", index)
        if self.device_request == "cuda":
            raise ParallelxError(f"{self.name}: device 'cuda' asked for, but this process needs GPU {index} and "
                                 f"{gpus} GPU(s) are visible; use fewer processes per machine or --device cpu")
        return torch.device("cpu")

    # --------------------------------------------------------- model set-up
    # The public set-up calls are templates: each backend's work runs with the
    # random number generators saved and restored, so whatever a backend's
    # set-up draws (or not) cannot shift the user's dropout masks, shuffles or
    # augmentations: the same script draws the same numbers on every backend.
    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to :attr:`device` and wrap it for this backend."""
        self._require_init()
        buffers.warn_if_per_process(model, self.world_size)
        with keep_rng_state():
            wrapped = self._wrap_model(model)
        self._buffer_sync.track(self.unwrap(wrapped))
        return wrapped

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Wrap ``optimizer`` (built on the parameters of a model already passed
        to :meth:`wrap_model`).  The result is a ``torch.optim.Optimizer``: LR
        schedulers built on it afterwards work on every backend."""
        self._require_init()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        with keep_rng_state():
            wrapped = self._wrap_optimizer(optimizer)
        if self.world_size > 1:  # rank 0's buffers on every rank after each step (see parallelx.buffers)
            self._buffer_sync.attach(params, wrapped)
        return wrapped

    @abc.abstractmethod
    def _wrap_model(self, model: nn.Module) -> nn.Module:
        """The backend's own model wrapping (called by :meth:`wrap_model`)."""

    def _wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The backend's own optimizer wrapping (called by :meth:`wrap_optimizer`)."""
        return optimizer

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
              ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """``wrap_model`` then ``wrap_optimizer`` in one call.  Returns
        ``(model, optimizer)``; the optimizer is None when none was given."""
        self._require_init()
        wrapped = self.wrap_model(model)
        return wrapped, (self.wrap_optimizer(optimizer) if optimizer is not None else None)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's original module inside whatever wrapper the backend added."""
        while hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        return model

    # --------------------------------------------------------- the training loop
    # backward(), step(), batches() and autocast() carry the loop options
    # (parallelx.loop.LoopOptions): the same loop gives the same update on
    # every backend.  Each backend supplies only its native mechanism, through
    # the hooks below them.
    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Wrap the forward pass and the loss in this: ``torch.autocast`` to the
        ``precision``'s dtype on this backend's device (nothing for ``32``).
        The weights stay float32; only the computation is in low precision."""
        dtype = self.options.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def batches(self, loader: Iterable[T], *, limit: int | None = None) -> Iterator[T]:
        """The batches of ``loader``, in windows of ``accumulate`` micro-batches.

        Inside a window, gradients stay on each rank (no all-reduce before the
        last micro-batch, by each backend's own mechanism); the last window of
        the pass may be shorter and is still applied.  Every rank gets the same
        number of batches: when the ranks' loaders differ in length (a sampler
        of the user's, an iterable dataset), every rank stops where the shortest
        does, so no rank waits for a collective that never comes.  ``limit``
        caps the number of batches of this pass.
        """
        self._require_init()
        if limit is not None and limit < 1:
            raise ParallelxError(f"batches(limit=...) must be >= 1, got {limit}")
        n = self._agreed_length(loader, limit)
        size = self.options.accumulate
        iterator = iter(loader)
        try:
            if n is not None:
                for i in range(n):
                    try:
                        batch = next(iterator)
                    except StopIteration:
                        raise ParallelxError(f"the loader ended after {i} batches although its len() is "
                                             f"{n}; other ranks may now wait for this one") from None
                    start = i - i % size
                    yield from self._micro_batch(batch, Window(i - start, min(size, n - start), managed=True))
                return
            # Lengths unknown: read a window ahead, then agree on how much of it every rank has.
            seen = 0
            while True:
                want = size if limit is None else min(size, limit - seen)
                window = list(itertools.islice(iterator, want))
                k = int(self.all_reduce(torch.tensor([len(window)]), op="min").item()) if self.world_size > 1 \
                    else len(window)
                if k < len(window):
                    log.warn(f"{self.name}: another rank ran out of batches; this rank stops too (policy: every "
                             "rank stops with the shortest, so no collective waits for a rank that has finished)")
                for j in range(k):
                    yield from self._micro_batch(window[j], Window(j, k, managed=True))
                seen += k
                if k < want or (limit is not None and seen >= limit):
                    return
        finally:
            self._window = SINGLE

    def _agreed_length(self, loader: Iterable[Any], limit: int | None) -> int | None:
        """The number of batches every rank takes this pass: the shortest rank's
        ``len(loader)`` (capped by ``limit``), or None when a rank's loader has no length."""
        try:
            n = len(loader)  # type: ignore[arg-type]
        except TypeError:
            n = -1
        if n >= 0 and limit is not None:
            n = min(n, limit)
        if self.world_size > 1:
            both = self.all_reduce(torch.tensor([n, -n]), op="max")  # [longest, -shortest] in one collective
            longest, shortest = int(both[0]), -int(both[1])
            if shortest < 0:
                return None
            if shortest != longest:
                log.warn(f"{self.name}: the ranks' loaders give {shortest} to {longest} batches; every rank takes "
                         f"{shortest} (the rest of the longer shards is left out of this pass)")
            n = shortest
        return None if n < 0 else n

    def _micro_batch(self, batch: T, window: Window) -> Iterator[T]:
        self._window = window
        # Inside a window the forward *and* the backward run under the backend's no-sync.
        with self._no_sync() if not window.boundary else contextlib.nullcontext():
            yield batch
        self._window = SINGLE

    def backward(self, loss: torch.Tensor, *, model: nn.Module | None = None) -> None:
        """Backpropagate ``loss`` (the mean over this micro-batch).  Under
        accumulation it is divided by the window's length here, once, the same
        way on every backend; the ``loss`` you hold and log is left as it is.
        ``model`` names the wrapped model the loss trains; only needed by
        backends whose backward belongs to a model (DeepSpeed) when several
        models are set up."""
        window = self._window
        if self.options.accumulate > 1 and not window.managed:
            raise ParallelxError(f"{self.name}: accumulate={self.options.accumulate} needs the loop to run over "
                                 "backend.batches(loader), which marks the accumulation windows")
        if window.size > 1:
            loss = loss / window.size
        if self.grad_scaler is not None:
            loss = self.grad_scaler.scale(loss)
        with self._watch("backward (the gradient all-reduce)"):
            self._backward(loss, model=model, boundary=window.boundary)

    def step(self, optimizer: torch.optim.Optimizer, scheduler: Any = None) -> StepResult | None:
        """End the micro-batch: inside an accumulation window do nothing and
        return None; at its end average the gradients over the ranks (where
        the backend has not yet), unscale them (16-mixed), clip them to
        ``clip_grad_norm``, step the optimizer, step ``scheduler`` once (not
        after a skipped step), zero the gradients, and return the
        :class:`~parallelx.loop.StepResult`."""
        self._require_init()
        if not self._window.boundary:
            return None
        with self._watch("the optimizer step (gradient synchronisation)"):
            self._sync_gradients(optimizer)
            if self.grad_scaler is not None:
                self.grad_scaler.unscale_(optimizer)
            norm = self._clip_gradients(optimizer, self.options.clip_grad_norm)
            skipped = self._apply_step(optimizer)
            if norm is None:
                norm = self._stepped_grad_norm(optimizer)
        if scheduler is not None and not skipped:
            scheduler.step()
        optimizer.zero_grad()
        return StepResult(grad_norm=norm.detach(), skipped=skipped)

    def set_options(self, **changes: Any) -> LoopOptions:
        """Change loop options (``accumulate``, ``clip_grad_norm``,
        ``precision``, ``grad_compression``) after construction.  The loop
        uses them at once; what a backend builds into its wrappers (DeepSpeed's
        config, Horovod's optimizer, DDP's communication hook) follows for the
        models and optimizers set up afterwards."""
        options = dataclasses.replace(self.options, **changes)
        self._check_options(options)
        if options.precision == "16-mixed" and self._initialized and self.device.type != "cuda":
            raise ParallelxError(f"{self.name}: precision 16-mixed needs a CUDA GPU; use bf16-mixed on the CPU")
        self.options = options
        self._options_changed()
        if self._initialized:
            self.grad_scaler = self._make_grad_scaler()
        return options

    # Hooks of the loop, overridden where a backend does things its own way.
    def _options_changed(self) -> None:
        """Rebuild whatever the backend derived from :attr:`options`."""

    def _check_options(self, options: LoopOptions) -> None:
        """Reject, at construction, loop options this backend cannot honour."""

    def _make_grad_scaler(self) -> torch.amp.GradScaler | None:
        """The loss scaler for ``16-mixed``; None for backends that scale by themselves."""
        return torch.amp.GradScaler(self.device.type) if self.options.precision == "16-mixed" else None

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
        scaler = self.grad_scaler
        if scaler is None:
            optimizer.step()
            return False
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        return scaler.get_scale() < before  # the scale backs off exactly when the step was skipped

    def _stepped_grad_norm(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        return torch.tensor(float("nan"))

    # ----------------------------------------------------------------- data
    def make_sampler(self, dataset: Sized, *, shuffle: bool = True, seed: int = 0,
                     drop_last: bool = False) -> ShardedSampler:
        """A sampler giving this rank its shard of ``dataset``.  The shards of all
        ranks are disjoint and cover the dataset (padded to equal length;
        :class:`parallelx.MetricSums` given this sampler leaves the padding out
        of metrics).  The shuffle changes every epoch without any ``set_epoch`` call."""
        return ShardedSampler(dataset, num_replicas=self.world_size, rank=self.rank,
                              shuffle=shuffle, seed=seed, drop_last=drop_last)

    # ---------------------------------------------------------- collectives
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Reduce ``tensor`` over all ranks and return the result (a new tensor,
        on ``tensor``'s device; the input is left unchanged).  ``mean`` of an
        integer tensor is returned as float."""
        check_op(op)
        self._require_init()
        out = tensor.detach().to(self._comm_device(tensor), copy=True)
        if op == "mean" and not out.is_floating_point():
            out = out.double()
        # Gloo has no AVG: every backend sums and divides, so mean means the same everywhere.
        with self._watch("all_reduce"):
            out = self._reduce(out, "sum" if op == "mean" else op)
        if op == "mean":
            out = out / self.world_size
        return out.to(tensor.device)

    def _comm_device(self, tensor: torch.Tensor) -> torch.device:
        """Where collectives need ``tensor`` to be."""
        return tensor.device

    @abc.abstractmethod
    def _reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """Reduce ``tensor`` (``sum``, ``max`` or ``min``) over all ranks; may work in place."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Wait until every rank reaches this point."""

    @abc.abstractmethod
    def broadcast(self, obj: T, src: int = 0) -> T:
        """Return rank ``src``'s ``obj`` on every rank.  Tensors are sent as
        tensors (same shape and dtype on every rank); anything else is pickled."""

    # ------------------------------------------------------------ gathering
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along dim 0 in rank order (a new
        tensor on ``tensor``'s device).  The first dimension may differ between
        ranks; the others and the dtype must match.  A 0-dim tensor counts as
        shape ``[1]``.  A collective: every rank must call it."""
        self._require_init()
        return self._gather_rows(tensor)[0]

    def _gather_rows(self, tensor: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """:meth:`all_gather`'s result and the number of rows each rank gave."""
        local = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
        # Agree on shapes first, so that a mismatch is one clear error on every rank, not a hang.
        shapes = self.all_gather_object((tuple(local.shape), str(local.dtype)))
        if any(s[1:] != shapes[0][0][1:] or d != shapes[0][1] for s, d in shapes):
            seen = ", ".join(f"rank {r}: {list(s)} {d}" for r, (s, d) in enumerate(shapes))
            raise ParallelxError(f"all_gather needs the same dtype and the same sizes after dim 0 on every rank, "
                                 f"got {seen}")
        wire = local.to(self._comm_device(local)).contiguous()
        if wire.dtype == torch.bool:  # Gloo and Horovod move bytes, not bools
            wire = wire.to(torch.uint8)
        out = torch.cat(self._all_gather(wire)).to(device=tensor.device, dtype=local.dtype)
        return out, [s[0] for s, _ in shapes]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (anything picklable), as a list indexed by rank.
        A collective: every rank must call it."""
        self._require_init()
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        parts = self._all_gather(payload.to(self._comm_device(payload)))
        return [pickle.loads(part.cpu().numpy().tobytes()) for part in parts]

    def gather_in_order(self, tensor: torch.Tensor, sampler: ShardedSampler) -> torch.Tensor:
        """Per-sample rows that this rank produced over one whole pass of
        ``sampler`` (row ``j`` for the ``j``-th index it gave), gathered from all
        ranks and returned in dataset order: row ``i`` is sample ``i``, the
        sampler's padding duplicates left out.  Call it after the pass, before
        the next one starts.  A collective: every rank must call it."""
        self._require_init()
        if not isinstance(sampler, ShardedSampler):
            raise ParallelxError(f"gather_in_order needs the parallelx ShardedSampler the loader drew from "
                                 f"(backend.make_sampler(dataset)), got {type(sampler).__name__}; with another "
                                 "sampler use backend.all_gather and order the rows yourself")
        if (sampler.num_replicas, sampler.rank) != (self.world_size, self.rank):
            raise ParallelxError(f"gather_in_order: the sampler shards for rank {sampler.rank} of "
                                 f"{sampler.num_replicas}, but this is rank {self.rank} of {self.world_size}; "
                                 "build it with backend.make_sampler(dataset)")
        index = sampler.dataset_index()
        gathered, counts = self._gather_rows(tensor)
        if any(n != len(sampler) for n in counts):  # every rank sees the same counts: all raise
            raise ParallelxError(f"gather_in_order: each rank's shard has {len(sampler)} samples per pass, but the "
                                 f"ranks gave {counts} rows; give one row per sample of a whole pass (a loader "
                                 "with drop_last=True, or a pass cut short, leaves samples out)")
        return gathered.index_select(0, index.to(gathered.device))

    @abc.abstractmethod
    def _all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (on :meth:`_comm_device`, contiguous, not bool),
        as a list indexed by rank.  The first dimension may differ between ranks;
        the others and the dtype are the same on every rank."""

    # ---------------------------------------------------- synchronised BatchNorm
    def sync_batchnorm(self, model: nn.Module) -> nn.Module:
        """``model`` with its BatchNorm layers normalising with the statistics of
        the global batch (all ranks' samples) in training.  Call it before
        :meth:`wrap_model`.  Returns the model (converted in place where it can
        be); unchanged in a world of one process, whose statistics are global."""
        self._require_init()
        from .utils import has_batchnorm

        if not has_batchnorm(model):
            return model
        with keep_rng_state():
            model = self._sync_batchnorm(model)
        if self.world_size > 1:
            buffers.mark_global_statistics(model)
        return model

    def _sync_batchnorm(self, model: nn.Module) -> nn.Module:
        """The backend's own conversion.  This one reduces the statistics through
        :meth:`all_reduce`, on any device; backends with a native
        synchronised BatchNorm for GPUs use theirs there."""
        if self.world_size == 1:
            return model
        from .batchnorm import SyncBatchNorm, convert_batchnorm

        return convert_batchnorm(model, SyncBatchNorm, reduce=lambda t: self.all_reduce(t, "sum"))

    # ---------------------------------------------------------- checkpoints
    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full, unwrapped ``state_dict`` as CPU tensors.  A collective on
        backends that shard parameters: every rank must call it."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.unwrap(model).state_dict().items()}

    def optimizer_state_dict(self, optimizer: Any) -> dict[str, Any] | None:
        """A plain ``torch.optim`` state dict (tensors on the CPU), or None with a
        warning when the backend keeps it in a form that cannot be made portable."""
        return checkpoint.to_cpu(optimizer.state_dict())

    def named_optimizer_state(self, model: nn.Module, optimizer: Any) -> dict[str, Any]:
        """The optimizer's whole state in ``torch.optim``'s layout, keyed by the
        names of ``model``'s parameters (``{"state": {"fc1.weight": {...}},
        "param_groups": [{..., "params": ["fc1.weight", ...]}]}``), tensors on
        the CPU.  A collective on backends that shard it: every rank must call it."""
        from .trainstate import named_optimizer_state

        names = {id(p): n for n, p in self.unwrap(model).named_parameters()}
        return named_optimizer_state(optimizer, names)

    def load_named_optimizer_state(self, model: nn.Module, optimizer: Any, state: Mapping[str, Any]) -> None:
        """Load what :meth:`named_optimizer_state` returned (on any backend, at
        any world size), matching parameters by name.  Every rank calls it."""
        from .trainstate import load_named_optimizer_state

        names = {id(p): n for n, p in self.unwrap(model).named_parameters()}
        load_named_optimizer_state(optimizer, names, state)

    def portable(self, obj: Any) -> Any:
        """``obj`` with every model and optimizer replaced by its plain state dict.
        A collective: every rank must call it with the same structure."""
        return checkpoint.portable(obj, self.model_state_dict, self.optimizer_state_dict)

    def save(self, obj: Any, path: str | os.PathLike[str]) -> None:
        """Write ``obj`` to one plain PyTorch file that ``torch.load`` reads
        without any backend package.  **Every rank must call this** (gathering
        sharded state is collective); only the main rank writes.  ``obj`` is a
        model or a dict whose values may be models, optimizers, tensors and
        plain Python values.  The write is atomic: a failure leaves any
        previous file intact, and raises on every rank."""
        self._require_init()
        state = self.portable(obj)
        error: str | None = None
        if self.is_main():
            try:
                checkpoint.atomic_save(state, path)
            except Exception as exc:  # reported to every rank below
                error = f"saving {path} failed on rank 0: {type(exc).__name__}: {exc}"
        # The broadcast doubles as the barrier: no rank moves on before the file exists.
        error = self.broadcast(error, src=0)
        if error is not None:
            raise ParallelxError(error)

    def load(self, path: str | os.PathLike[str], *, weights_only: bool = True) -> Any:
        """Read a checkpoint written by :meth:`save` (by any backend, at any world
        size) onto the CPU.  Every rank reads the file."""
        return checkpoint.load(path, weights_only=weights_only)

    def load_state_dict(self, target: nn.Module | Any, state: Mapping[str, Any]) -> None:
        """Load a portable state dict into a (wrapped) model or optimizer."""
        if isinstance(target, nn.Module):
            self.unwrap(target).load_state_dict(state)
        else:
            target.load_state_dict(state)

    # ---------------------------------------------------------- elastic runs
    def run_elastic(self, train: Callable[[], T]) -> T:
        """Run ``train()`` so that the job outlives a lost rank where the
        launcher can change the world while it runs (``horovodrun --min-np
        --max-np --host-discovery-script``); elsewhere call it once.

        When a rank dies, or hosts join or leave, every remaining rank leaves
        ``train()`` by an exception, the backend joins the new world
        (:attr:`rank`, :attr:`world_size` and the local sizes change) and calls
        ``train()`` again.  So ``train`` starts from the beginning each time:
        it builds and wraps the model and optimizer, makes the sampler with
        :meth:`make_sampler` (sharded for the world it runs in), loads
        ``parallelx.latest_checkpoint(run_dir)`` when there is one, and every
        few steps calls ``parallelx.save_training_state`` then
        :meth:`elastic_commit`.  Whatever was done after the last checkpoint is
        done again, by the new world; models and optimizers of an earlier call
        must not be used again.  Returns what ``train()`` returned."""
        self._require_init()
        return train()

    def elastic_commit(self) -> None:
        """Mark the checkpoint just saved as the point an elastic run
        (:meth:`run_elastic`) goes back to; hosts waiting to join or leave take
        effect here, which may end ``train()`` to form the new world.  Every
        rank calls it; outside an elastic run it does nothing."""
        self._require_init()


@contextlib.contextmanager
def keep_rng_state() -> Iterator[None]:
    """Run the block, then put Python's, NumPy's and torch's (CPU and CUDA)
    random number generators back where they were."""
    py, np_state, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(np_state)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _check_device(device: str | torch.device | None) -> str:
    if device is None:
        return "auto"
    name = device.type if isinstance(device, torch.device) else str(device)
    if name not in DEVICES:
        raise ParallelxError(f"device must be one of {', '.join(DEVICES)}, got {device!r} "
                             "(the GPU index follows the process's local rank)")
    return name
