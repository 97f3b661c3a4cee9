"""The ``Backend`` protocol: what a training script asks of a distributed
backend (``recipes/example.py`` shows the whole loop), and what a backend's
author implements.

``Backend`` is the strategy: lifecycle, device, wrapping, collectives.  The
rest lives in modules of its own and is reached in one to three lines from
here: where the ranks come from (:mod:`parallelx.environments`), the loop
(:mod:`parallelx.loop`), precision (:mod:`parallelx.precision`), gathering
(:mod:`parallelx.gather`), buffers (:mod:`parallelx.buffers`), synchronised
BatchNorm (:mod:`parallelx.batchnorm`), files (:mod:`parallelx.checkpoint`).
It is abstract in what a multi-process backend must get right (joining,
wrapping, collectives): a backend that forgets one fails at class creation.
"""

from __future__ import annotations

import abc
import argparse
import atexit
import contextlib
import dataclasses
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from . import buffers, checkpoint, gather, log
from .batchnorm import SyncBatchNorm, convert_batchnorm
from .checkpoint import StateHooks
from .elastic import ElasticHooks
from .environments import ClusterEnvironment, detect_environment
from .errors import LaunchError, ParallelxError
from .launch import PYTHON, Launcher
from .loop import LoopHooks, LoopOptions, StepResult, TrainingLoop
from .precision import Precision
from .sampler import ShardedSampler
from .settings import (  # noqa: F401
    DEFAULT_TIMEOUT_S,
    DEVICES,
    REDUCE_OPS,
    ReduceOp,
    check_device,
    check_op,
    check_timeout,
    common_options,
    default_timeout,
    limit_cpu_threads,
    pick_device,
)
from .state import keep_rng_state
from .tracking import Monitor, MonitorOptions
from .utils import has_batchnorm, missing_package
from .watchdog import Watchdog

T = TypeVar("T")


class Backend(LoopHooks, StateHooks, ElasticHooks, abc.ABC):
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
    #: The cluster environments (:mod:`parallelx.environments`) this backend
    #: can form its world in; None: it ignores them (a world of one process).
    environments: ClassVar[tuple[str, ...] | None] = None

    def __init__(
        self,
        *,
        timeout: float | None = None,
        device: str | torch.device | None = None,
        verbose: bool = True,
        accumulate: int = 1,
        clip_grad_norm: float | None = None,
        precision: str = "32",
        grad_compression: str = "none",
        environment: ClusterEnvironment | None = None,
        loggers: str | Sequence[str] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        monitor: MonitorOptions | Mapping[str, Any] | None = None,
    ) -> None:
        #: True when the user chose the timeout (argument or $PARALLELX_TIMEOUT),
        #: which then overrides a launcher's own default.
        self.timeout_explicit = timeout is not None or "PARALLELX_TIMEOUT" in os.environ
        self.timeout_s: float = default_timeout() if timeout is None else check_timeout(float(timeout), "timeout")
        self.device_request: str = check_device(device)
        self.verbose = verbose
        self._initialized = False
        self._rank, self._world_size, self._local_rank, self._local_world_size = 0, 1, 0, 1
        self._device = torch.device("cpu")
        #: What the backend does to the update besides averaging (see :mod:`parallelx.loop`).
        self.options = LoopOptions(
            accumulate=accumulate, clip_grad_norm=clip_grad_norm, precision=precision, grad_compression=grad_compression
        )
        self._check_options(self.options)
        #: Where this process's rank and world come from: given, or detected by init().
        self.environment: ClusterEnvironment | None = environment
        #: Trackers, throughput and profiles (:mod:`parallelx.tracking`); the loop marks its steps for it.
        self.monitor = Monitor(self, MonitorOptions.make(monitor, loggers=loggers, log_dir=log_dir))
        self._loop = TrainingLoop(self)
        #: Everything ``precision`` changes (:class:`parallelx.precision.Precision`); made again by init().
        self.precision: Precision = self._make_precision()
        self._watchdog: Watchdog | None = None
        self._buffer_sync = buffers.BufferSync(lambda t: self.broadcast(t, src=0))

    # ------------------------------------------------------------------ info
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
        return (
            f"{type(self).__name__}(name={self.name!r}, rank={self.rank}, "
            f"world_size={self.world_size}, device={str(self.device)!r})"
        )

    # --------------------------------------------------------- launch hooks
    @classmethod
    def detect(cls, environ: Mapping[str, str], argv: Sequence[str]) -> int:
        """For third-party backends: how strongly the environment asks for this
        one (0: not at all; the cluster environment's choice stands)."""
        return 0

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add this backend's own command-line options (called for every
        backend, so a script accepts all of them whichever backend runs)."""

    @classmethod
    def options_from_args(cls, args: argparse.Namespace) -> dict[str, Any]:
        """Constructor options for this backend from parsed command-line args."""
        return common_options(args)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run here, or None (its package is not imported to find out)."""
        return missing_package(cls.requires_module, cls.install_hint)

    # ------------------------------------------------------------ lifecycle
    def init(self) -> Backend:
        """Join the world (if any) and choose the device.  A second call does nothing.
        Returns the backend, so ``backend = get_backend("ddp").init()`` reads well."""
        if self._initialized:
            return self
        env = self.environment = self.environment or detect_environment()
        if self.environments is not None and env.name not in self.environments:
            raise LaunchError(
                f"{self.name} cannot form its world under {env.name} ({env.why()}); it runs under "
                f"{', '.join(self.environments)}: start it with `{self.launcher.usage()} --backend "
                f"{self.name} ...`{env.hint()}"
            )
        log.set_rank(env.world().rank)  # from here on, warnings come from rank 0 only (parallelx.log)
        with keep_rng_state():
            self._init()
        self._initialized = True
        log.set_rank(self.rank)
        limit_cpu_threads(self.device, self.local_world_size)
        try:
            self.precision = self._make_precision()  # on the device now known (16-mixed needs CUDA)
        except ParallelxError as exc:
            self.abort()
            raise ParallelxError(f"{self.name}: {exc}") from None
        if self.needs_watchdog and self.world_size > 1:
            self._watchdog = Watchdog(self.timeout_s, self.rank)
        # A script that ends without shutdown() (it raised, or forgot) still
        # releases the process group before the interpreter is torn down, while
        # the threads of its communication library can still take the GIL.
        atexit.register(self.abort)
        return self

    @abc.abstractmethod
    def _init(self) -> None:
        """The backend's own start-up in :attr:`environment`: join the process
        group, then set ``_rank``, ``_world_size``, ``_local_rank``,
        ``_local_world_size`` and ``_device``.  Called once, by :meth:`init`."""

    def shutdown(self) -> None:
        """Leave the world and release what the backend holds.  Every rank calls
        it at the end of a successful run.  Safe to call more than once."""
        if self._initialized:
            try:
                with self._watch("shutdown"):
                    self.monitor.close()  # the last metrics (a collective when reduced), the trackers closed
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
                self.monitor.close(failed=True)
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

    def _require_init(self) -> None:
        if not self._initialized:
            raise ParallelxError(
                f"backend {self.name!r} is not initialised: call backend.init() (or use `with backend:`) first"
            )

    def _pick_device(self, index: int) -> torch.device:
        """The device for a process that may use GPU ``index`` (:func:`parallelx.settings.pick_device`)."""
        return pick_device(self.device_request, index, self.name)

    # --------------------------------------------------------- model set-up
    # Templates: a backend's own work runs with the random generators saved and
    # restored, so whatever its set-up draws cannot shift the user's dropout
    # masks, shuffles or augmentations: the same numbers on every backend.
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
        if self.world_size > 1:  # rank 0's buffers on every rank after each step (parallelx.buffers)
            self._buffer_sync.attach(params, wrapped)
        return wrapped

    @abc.abstractmethod
    def _wrap_model(self, model: nn.Module) -> nn.Module:
        """The backend's own model wrapping (called by :meth:`wrap_model`)."""

    def _wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The backend's own optimizer wrapping (called by :meth:`wrap_optimizer`)."""
        return optimizer

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """``wrap_model`` then ``wrap_optimizer``; the optimizer returned is None when none was given."""
        self._require_init()
        wrapped = self.wrap_model(model)
        return wrapped, (self.wrap_optimizer(optimizer) if optimizer is not None else None)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's original module inside whatever wrapper the backend added."""
        while hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        return model

    # --------------------------------------------------------- the training loop
    # The loop is parallelx.loop.TrainingLoop: the same update on every backend;
    # a backend supplies only its native mechanism, through parallelx.loop.LoopHooks.
    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """``torch.autocast`` to the ``precision``'s dtype (nothing for ``32``), for the forward and the loss."""
        return self.precision.autocast()

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """The loss scaler of ``16-mixed`` (None otherwise, or when the backend scales by itself)."""
        return self.precision.scaler

    def batches(self, loader: Iterable[T], *, limit: int | None = None) -> Iterator[T]:
        """The batches of ``loader`` (at most ``limit``), in windows of
        ``accumulate`` micro-batches with no gradient exchange inside one; the
        same number on every rank (see :class:`parallelx.loop.TrainingLoop`)."""
        self._require_init()
        return self._loop.batches(loader, limit)

    def backward(self, loss: torch.Tensor, *, model: nn.Module | None = None) -> None:
        """Backpropagate ``loss`` (this micro-batch's mean), divided once by the
        window's length.  ``model`` names the model it trains, where a backend
        needs it (several DeepSpeed models)."""
        self._loop.backward(loss, model)

    def step(self, optimizer: torch.optim.Optimizer, scheduler: Any = None) -> StepResult | None:
        """None inside a window; at its end: average, unscale, clip, step the
        optimizer and ``scheduler`` (not after a skipped step), zero the
        gradients, and return the :class:`~parallelx.loop.StepResult`."""
        self._require_init()
        return self._loop.step(optimizer, scheduler)

    def log_metrics(
        self,
        metrics: Mapping[str, Any],
        *,
        step: int | None = None,
        reduce: str | Mapping[str, str | None] | None = None,
    ) -> None:
        """Log ``metrics`` (name -> number or one-element tensor) at ``step`` (default: optimizer steps so far) to the
        ``loggers``.  Call it on every rank; rank 0 writes.  Tensors are read in one batch at the next logging interval,
        never here.  ``reduce`` (``"mean"``, ``"sum"``, ``"max"``, ``"min"``, or a dict of name -> operation)
        reduces across the ranks; without it, rank 0's own values are written.  See :mod:`parallelx.tracking`."""
        self.monitor.log_metrics(metrics, step, reduce)

    def set_options(self, **changes: Any) -> LoopOptions:
        """Change loop options (``accumulate``, ``clip_grad_norm``, ``precision``,
        ``grad_compression``): the loop uses them at once; what a backend builds
        into its wrappers follows for the models and optimizers set up afterwards."""
        options = dataclasses.replace(self.options, **changes)
        self._check_options(options)
        old, self.options = self.options, options
        try:
            precision = self._make_precision() if self._initialized else self.precision
        except ParallelxError as exc:
            self.options = old
            raise ParallelxError(f"{self.name}: {exc}") from None
        self.precision = precision
        self._options_changed()
        return options

    # ----------------------------------------------------------------- data
    def make_sampler(
        self, dataset: Sized, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False
    ) -> ShardedSampler:
        """This rank's shard of ``dataset``: disjoint shards that cover it, padded
        to equal length (``MetricSums`` leaves the padding out); a new shuffle
        every epoch without ``set_epoch``."""
        return ShardedSampler(
            dataset, num_replicas=self.world_size, rank=self.rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )

    # ---------------------------------------------------------- collectives
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Reduce ``tensor`` over all ranks into a new tensor on its device (the
        input is left unchanged); ``mean`` of an integer tensor is a float."""
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

    @abc.abstractmethod
    def _all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (on :meth:`_comm_device`, contiguous, not bool),
        as a list indexed by rank.  The first dimension may differ between ranks;
        the others and the dtype are the same on every rank."""

    # ------------------------------------------------------------ gathering (parallelx.gather)
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along dim 0 in rank order; first
        dimensions may differ (a 0-dim tensor counts as ``[1]``).  A collective."""
        self._require_init()
        return gather.gather_rows(self, tensor)[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's (picklable) ``obj``, as a list indexed by rank.  A collective."""
        self._require_init()
        return gather.all_gather_object(self, obj)

    def gather_in_order(self, tensor: torch.Tensor, sampler: ShardedSampler) -> torch.Tensor:
        """The per-sample rows of one whole pass of ``sampler`` from every rank,
        in dataset order (row ``i`` is sample ``i``), padding left out.  Call it
        after the pass, before the next one starts.  A collective."""
        self._require_init()
        return gather.gather_in_order(self, tensor, sampler)

    # ---------------------------------------------------- synchronised BatchNorm
    def sync_batchnorm(self, model: nn.Module) -> nn.Module:
        """``model`` with BatchNorm over the global batch in training; call it
        before :meth:`wrap_model`.  Unchanged in a world of one process."""
        self._require_init()
        if not has_batchnorm(model):
            return model
        with keep_rng_state():
            model = self._sync_batchnorm(model)
        if self.world_size > 1:
            buffers.mark_global_statistics(model)
        return model

    def _sync_batchnorm(self, model: nn.Module) -> nn.Module:
        """The backend's own conversion; this one reduces through :meth:`all_reduce`
        on any device (backends with a native GPU one use theirs there)."""
        if self.world_size == 1:
            return model
        return convert_batchnorm(model, SyncBatchNorm, reduce=lambda t: self.all_reduce(t, "sum"))

    # ------------------------------------------- checkpoints (the state hooks: parallelx.checkpoint.StateHooks)
    def portable(self, obj: Any) -> Any:
        """``obj`` with every model and optimizer replaced by its plain state dict.
        A collective: every rank must call it with the same structure."""
        return checkpoint.portable(obj, self.model_state_dict, self.optimizer_state_dict)

    def save(self, obj: Any, path: str | os.PathLike[str]) -> None:
        """Write ``obj`` (a model, or a dict of models, optimizers, tensors and
        plain values) to one plain PyTorch file.  **Every rank calls it**
        (gathering sharded state is collective); rank 0 writes, atomically; a
        failure leaves any previous file intact and raises on every rank."""
        self._require_init()
        checkpoint.save_on_main(
            self.portable(obj), path, is_main=self.is_main(), broadcast=lambda error: self.broadcast(error, src=0)
        )

    def load(self, path: str | os.PathLike[str], *, weights_only: bool = True) -> Any:
        """Read a file written by :meth:`save` (any backend, any world size) onto the CPU."""
        return checkpoint.load(path, weights_only=weights_only)

    def load_state_dict(self, target: nn.Module | Any, state: Mapping[str, Any]) -> None:
        """Load a portable state dict into a (wrapped) model or optimizer."""
        if isinstance(target, nn.Module):
            self.unwrap(target).load_state_dict(state)
        else:
            target.load_state_dict(state)
