"""The ``Backend`` protocol: what a training script asks of a distributed
backend (``recipes/example.py`` shows the whole loop).

``Backend`` is a facade.  What users call is here; what a backend does is in
the parts it is made of, each a small class with public methods of its own:

========================  ==============================================  ===========================
part                      what it does                                    attribute
========================  ==============================================  ===========================
collectives               reduce, broadcast, barrier, gather              ``backend.comm``
gradient synchronisation  no-sync windows, backward, the boundary         ``backend.grad_sync``
                          reduce, clipping's norm, the step
precision                 autocast, loss scale, skipped steps             ``backend.precision``
state in and out          whole or sharded model and optimizer state     ``backend.state_io``
environment               where the ranks come from                       ``backend.environment``
watchdog                  ends a rank whose peer stalled                  ``backend.watchdog``
elastic                   runs again in a new world after a lost rank     ``backend.elastic``
monitor                   trackers, throughput and MFU, profiles          ``backend.monitor``
========================  ==============================================  ===========================

A backend module (``backends/<name>.py``) joins its world in ``_init`` and
chooses its parts there, and wraps models in ``_wrap_model``; everything else
has a default here.  The loop (:mod:`parallelx.parts.loop`), the gathering
(:mod:`parallelx.parts.gather`), the buffers (:mod:`parallelx.transforms.buffers`) and the
training-state checkpoints (:mod:`parallelx.checkpoints.trainstate`) each take the part
they need and call its public methods only.
"""

from __future__ import annotations

import abc
import argparse
import atexit
import contextlib
import dataclasses
import os
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from parallelx import log
from parallelx.check import probe as checkprobe
from parallelx.check.probe import Probe
from parallelx.errors import LaunchError, ParallelxError
from parallelx.launching.environments import ClusterEnvironment, detect_environment
from parallelx.launching.launchers import PYTHON, Launcher
from parallelx.observability import Monitor, MonitorOptions
from parallelx.parts import gather
from parallelx.parts import portable as checkpoint
from parallelx.parts.collectives import Collectives, LocalCollectives
from parallelx.parts.elastic import Elastic
from parallelx.parts.gradsync import GradientSync
from parallelx.parts.loop import LoopOptions, StepResult, TrainingLoop
from parallelx.parts.precision import Precision
from parallelx.parts.sampler import ShardedSampler
from parallelx.parts.state import keep_rng_state
from parallelx.parts.stateio import StateIO
from parallelx.parts.watchdog import Watchdog
from parallelx.settings import (  # noqa: F401  (DEFAULT_TIMEOUT_S, DEVICES, REDUCE_OPS, default_timeout: documented here too)
    DEFAULT_TIMEOUT_S,
    DEVICES,
    REDUCE_OPS,
    ReduceOp,
    check_device,
    check_timeout,
    common_options,
    default_timeout,
    limit_cpu_threads,
    pick_device,
)
from parallelx.transforms import activations, buffers
from parallelx.transforms.batchnorm import SyncBatchNorm, convert_batchnorm
from parallelx.transforms.compiling import CompileOptions, compile_in_place, uncompiled
from parallelx.transforms.units import UnitPolicy
from parallelx.utils import has_batchnorm, missing_package

T = TypeVar("T")


class Backend(abc.ABC):
    """Base class of all backends: one module each under ``backends/``."""

    #: Registry name, e.g. ``"ddp"``.
    name: ClassVar[str] = ""
    #: One line for tables: what runs under this backend.
    summary: ClassVar[str] = ""
    #: How this backend's processes are started (see :mod:`parallelx.launching.launchers`).
    launcher: ClassVar[Launcher] = PYTHON
    #: The importable package this backend needs, if any, and how to install it.
    requires_module: ClassVar[str | None] = None
    install_hint: ClassVar[str] = ""
    #: Python code that ``python -m parallelx env`` runs in a fresh process to
    #: check that the package really works; it prints one line of detail.
    probe_code: ClassVar[str | None] = None
    #: True for backends whose collectives can wait forever for a stalled
    #: peer: parallelx then watches their blocking calls (see parallelx.parts.watchdog).
    needs_watchdog: ClassVar[bool] = False
    #: The cluster environments (:mod:`parallelx.launching.environments`) this backend
    #: can form its world in; None: it ignores them (a world of one process).
    environments: ClassVar[tuple[str, ...] | None] = None
    #: The precision part (:mod:`parallelx.parts.precision`); an engine that casts and scales by itself gives a variant.
    precision_class: ClassVar[type[Precision]] = Precision
    #: True for backends that can keep sharded state in CPU memory between uses (``cpu_offload=True``).
    offloads: ClassVar[bool] = False

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
        compile: bool | str | CompileOptions = False,
        activation_checkpointing: bool | UnitPolicy = None,
        cpu_offload: bool = False,
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
        #: What the backend does to the update besides averaging (see :mod:`parallelx.parts.loop`).
        self.options = LoopOptions(
            accumulate=accumulate,
            clip_grad_norm=clip_grad_norm,
            precision=precision,
            grad_compression=grad_compression,
        )
        self._check_options(self.options)
        #: Whether and how models are compiled (:mod:`parallelx.transforms.compiling`).
        self.compile_options = CompileOptions.of(compile)
        #: Which units recompute their activations in the backward (:mod:`parallelx.transforms.activations`);
        #: None: none, True: the default units.
        self.activation_checkpointing: UnitPolicy | bool = activation_checkpointing or None
        if cpu_offload and not self.offloads:
            raise ParallelxError(
                f"{self.name}: cpu_offload keeps sharded state in CPU memory; {self.name} keeps whole copies on the "
                "device: use --backend fsdp, or deepspeed with --zero-stage 1 to 3"
            )
        #: Sharded state kept in CPU memory between uses (fsdp: parameters and gradients; ZeRO: optimizer state).
        self.cpu_offload = bool(cpu_offload)
        #: Where this process's rank and world come from: given, or detected by init().
        self.environment: ClusterEnvironment | None = environment
        # The parts; a backend's _init() sets `comm` and replaces the others where it does differently.
        self.comm: Collectives = LocalCollectives()
        self.grad_sync: GradientSync = GradientSync(self._set_up_modules)
        self.state_io: StateIO = StateIO(self.unwrap)
        self.elastic: Elastic = Elastic()
        self.watchdog: Watchdog | None = None
        #: Trackers, throughput and profiles (:mod:`parallelx.observability`): a part too; the loop marks its steps for it.
        self.monitor = Monitor(self, MonitorOptions.make(monitor, loggers=loggers, log_dir=log_dir))
        #: Everything ``precision`` changes (:class:`parallelx.parts.precision.Precision`); made again by init().
        self.precision: Precision = self._make_precision()
        self.loop = self._make_loop()
        # The user's modules set up so far (weakly: an elastic run builds new ones), and their parameters
        # before and after wrapping (an optimizer may be built on either).
        self._modules: list[weakref.ref[nn.Module]] = []
        self._known_params: dict[int, weakref.ref[torch.Tensor]] = {}
        self._buffer_sync = buffers.BufferSync(lambda t: self.comm.broadcast(t, src=0))
        #: ``python -m parallelx check``'s probe in the processes it launches (:mod:`parallelx.check.probe`).
        self.probe: Probe | None = None

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
        if self.needs_watchdog:
            self.watchdog = Watchdog(self.timeout_s, env.world().rank)
        with keep_rng_state():
            self._init()
        if (self.comm.rank, self.comm.world_size) != (self._rank, self._world_size):
            raise ParallelxError(
                f"{self.name}: _init() joined rank {self._rank} of {self._world_size} but set collectives for "
                f"rank {self.comm.rank} of {self.comm.world_size}; a backend sets self.comm in _init()"
            )
        if self.watchdog is not None and self._world_size == 1:
            self.watchdog = None  # nobody to wait for
        self._initialized = True
        log.set_rank(self.rank)
        limit_cpu_threads(self.device, self.local_world_size)
        if self.cpu_offload and self.device.type != "cuda":
            self.abort()
            raise ParallelxError(
                f"{self.name}: --cpu-offload moves sharded state from the GPU's memory to the CPU's; this process "
                f"already runs on {self.device}: leave it out here"
            )
        try:
            self.precision = self._make_precision()  # on the device now known (16-mixed needs CUDA)
        except ParallelxError as exc:
            self.abort()
            raise ParallelxError(f"{self.name}: {exc}") from None
        self.loop = self._make_loop()
        # check: in a run `python -m parallelx check` launched, a probe records it (parallelx.check.probe);
        # in the check's one-process reference it plays N ranks, and the script sees rank 0 of N.
        self.probe = checkprobe.attach(self)
        if self.probe is not None and self.probe.virtual_ranks > 1:
            self._world_size = self.probe.virtual_ranks
        # A script that ends without shutdown() (it raised, or forgot) still
        # releases the process group before the interpreter is torn down, while
        # the threads of its communication library can still take the GIL.
        atexit.register(self.abort)
        return self

    @abc.abstractmethod
    def _init(self) -> None:
        """The backend's own start-up in :attr:`environment`: join the world,
        set ``_rank``, ``_world_size``, ``_local_rank``, ``_local_world_size``
        and ``_device``, and set the parts: ``comm`` always, ``grad_sync``,
        ``state_io`` and ``elastic`` where the backend does differently.
        Called once, by :meth:`init`."""

    def shutdown(self) -> None:
        """Leave the world and release what the backend holds.  Every rank calls
        it at the end of a successful run.  Safe to call more than once."""
        if self._initialized:
            if self.probe is not None:  # check: every rank is here, the probe's collectives are safe
                self.probe.finish()
            try:
                with self._watch("shutdown"):
                    self.monitor.close()  # the last metrics (a collective when reduced), the trackers closed
                    self._shutdown(failed=False)
            finally:
                self._initialized = False
                atexit.unregister(self.abort)
                if self.watchdog is not None:
                    self.watchdog.close()

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

    def _watch(self, what: str) -> contextlib.AbstractContextManager[Any]:
        """The watchdog (when this backend needs one) armed around a blocking call."""
        return self.watchdog.watch(what) if self.watchdog is not None else contextlib.nullcontext()

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

    def _make_precision(self) -> Precision:
        return self.precision_class(self.options.precision, self.device if self._initialized else None)

    def _make_loop(self) -> TrainingLoop:
        return TrainingLoop(
            self.name, self.grad_sync, self.comm, self._watch, self.options, self.precision, self.monitor
        )

    # --------------------------------------------------------- model set-up
    # Templates: a backend's own work runs with the random generators saved and
    # restored, so whatever its set-up draws cannot shift the user's dropout
    # masks, shuffles or augmentations: the same numbers on every backend.
    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to :attr:`device` and wrap it for this backend."""
        self._require_init()
        buffers.warn_if_per_process(model, self.world_size)
        model, compiled = uncompiled(model)
        if compiled and not self.compile_options.enabled:
            log.warn(
                f"{self.name}: the model was compiled before setup; parallelx compiles it again the way {self.name} "
                "needs, after wrapping (mode default; --compile-mode chooses another)"
            )
            self.compile_options = CompileOptions(enabled=True)
        known = list(model.parameters())
        if self.probe is not None:  # check: the initial weights, before any broadcast
            self.probe.before_wrap(model)
        checkpointing = self.activation_checkpointing
        if checkpointing is not None and checkpointing is not False:
            activations.apply(model, None if isinstance(checkpointing, bool) else checkpointing)
        with keep_rng_state():
            wrapped = self._wrap_model(model)
            if self.compile_options.enabled:
                self._compile(wrapped)
        module = self.unwrap(wrapped)
        self._known_params = {i: ref for i, ref in self._known_params.items() if ref() is not None}
        self._known_params.update((id(p), weakref.ref(p)) for p in [*known, *module.parameters()])
        self._modules = [ref for ref in self._modules if ref() is not None]
        self._modules.append(weakref.ref(module))
        self._buffer_sync.track(module)
        if self.probe is not None:  # check
            self.probe.wrapped_model(wrapped)
        return wrapped

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Wrap ``optimizer`` (built on the parameters of a model already passed
        to :meth:`wrap_model`).  The result is a ``torch.optim.Optimizer``: LR
        schedulers built on it afterwards work on every backend."""
        self._require_init()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        strangers = [p for p in params if (ref := self._known_params.get(id(p))) is None or ref() is not p]
        if strangers:
            raise ParallelxError(
                f"{self.name}: {len(strangers)} parameter(s) of this optimizer belong to no model passed to "
                "wrap_model; call `model = backend.wrap_model(model)` first, and build the optimizer on "
                "model.parameters() (or use backend.setup(model, optimizer))"
            )
        with keep_rng_state():
            wrapped = self._wrap_optimizer(optimizer)
        if self.world_size > 1:  # rank 0's buffers on every rank after each step (parallelx.transforms.buffers)
            live = [p for group in wrapped.param_groups for p in group["params"]]
            self._buffer_sync.attach([*params, *live], wrapped)
        if self.probe is not None:  # check
            wrapped = self.probe.wrapped_optimizer(wrapped)
        return wrapped

    @abc.abstractmethod
    def _wrap_model(self, model: nn.Module) -> nn.Module:
        """The backend's own model wrapping (called by :meth:`wrap_model`)."""

    def _wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The backend's own optimizer wrapping (called by :meth:`wrap_optimizer`)."""
        return optimizer

    def _compile(self, wrapped: nn.Module) -> None:
        """Compile a wrapped model as this backend needs (:mod:`parallelx.transforms.compiling`): here, in place."""
        compile_in_place(wrapped, self.compile_options)

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """``wrap_model`` then ``wrap_optimizer``; the optimizer returned is None when none was given."""
        self._require_init()
        wrapped = self.wrap_model(model)
        return wrapped, (self.wrap_optimizer(optimizer) if optimizer is not None else None)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's original module inside whatever wrapper the backend added
        (and inside ``torch.compile``'s)."""
        while True:
            inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
            if not isinstance(inner, nn.Module):
                inner = getattr(model, "module", None)
            if not isinstance(inner, nn.Module):
                return model
            model = inner

    def _set_up_modules(self) -> list[nn.Module]:
        """The user's modules passed to :meth:`wrap_model` that are still alive, in order."""
        return [m for ref in self._modules if (m := ref()) is not None]

    # --------------------------------------------------------- the training loop
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
        same number on every rank (see :class:`parallelx.parts.loop.TrainingLoop`)."""
        self._require_init()
        return self.loop.batches(loader, limit)

    def backward(self, loss: torch.Tensor, *, model: nn.Module | None = None) -> None:
        """Backpropagate ``loss`` (this micro-batch's mean), divided once by the
        window's length.  ``model`` names the model it trains, where a backend
        needs it (several DeepSpeed models)."""
        self.loop.backward(loss, model)

    def step(self, optimizer: torch.optim.Optimizer, scheduler: Any = None) -> StepResult | None:
        """None inside a window; at its end: average, unscale, clip, step the
        optimizer and ``scheduler`` (not after a skipped step), zero the
        gradients, and return the :class:`~parallelx.parts.loop.StepResult`."""
        self._require_init()
        return self.loop.step(optimizer, scheduler)

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
        reduces across the ranks; without it, rank 0's own values are written.  See :mod:`parallelx.observability`."""
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
        self.loop.options, self.loop.precision = options, precision
        self._options_changed()
        return options

    def _options_changed(self) -> None:
        """Rebuild whatever the backend derived from :attr:`options`."""

    def _check_options(self, options: LoopOptions) -> None:
        """Reject, at construction, loop options this backend cannot honour."""

    # ----------------------------------------------------------------- data
    def make_sampler(
        self, dataset: Sized, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False
    ) -> ShardedSampler:
        """This rank's shard of ``dataset``: disjoint shards that cover it, padded
        to equal length (``MetricSums`` leaves the padding out); a new shuffle
        every epoch without ``set_epoch``."""
        sampler = ShardedSampler(
            dataset, num_replicas=self.world_size, rank=self.rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        return sampler if self.probe is None else self.probe.made_sampler(sampler, dataset)  # check

    # ---------------------------------------------------------- collectives
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Reduce ``tensor`` over all ranks into a new tensor on its device (the
        input is left unchanged); ``mean`` of an integer tensor is a float."""
        self._require_init()
        return self.comm.all_reduce(tensor, op)

    def barrier(self) -> None:
        """Wait until every rank reaches this point."""
        self._require_init()
        self.comm.barrier()

    def broadcast(self, obj: T, src: int = 0) -> T:
        """Return rank ``src``'s ``obj`` on every rank.  Tensors are sent as
        tensors (same shape and dtype on every rank); anything else is pickled."""
        self._require_init()
        return self.comm.broadcast(obj, src)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along dim 0 in rank order; first
        dimensions may differ (a 0-dim tensor counts as ``[1]``).  A collective."""
        self._require_init()
        return gather.gather_rows(self.comm, tensor)[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's (picklable) ``obj``, as a list indexed by rank.  A collective."""
        self._require_init()
        return gather.all_gather_object(self.comm, obj)

    def gather_in_order(self, tensor: torch.Tensor, sampler: ShardedSampler) -> torch.Tensor:
        """The per-sample rows of one whole pass of ``sampler`` from every rank,
        in dataset order (row ``i`` is sample ``i``), padding left out.  Call it
        after the pass, before the next one starts.  A collective."""
        self._require_init()
        return gather.gather_in_order(self.comm, tensor, sampler)

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
        """The backend's own conversion; this one reduces through the collectives
        on any device (backends with a native GPU one use theirs there)."""
        if self.world_size == 1:
            return model
        return convert_batchnorm(model, SyncBatchNorm, reduce=lambda t: self.comm.all_reduce(t, "sum"))

    # ------------------------------------------------ checkpoints (the state part)
    def portable(self, obj: Any) -> Any:
        """``obj`` with every model and optimizer replaced by its plain state dict.
        A collective: every rank must call it with the same structure."""
        return checkpoint.portable(obj, self.state_io.model_state_dict, self.state_io.optimizer_state_dict)

    def save(self, obj: Any, path: str | os.PathLike[str]) -> None:
        """Write ``obj`` (a model, or a dict of models, optimizers, tensors and
        plain values) to one plain PyTorch file.  **Every rank calls it**
        (gathering sharded state is collective); rank 0 writes, atomically; a
        failure leaves any previous file intact and raises on every rank."""
        self._require_init()
        checkpoint.save_on_main(
            self.portable(obj), path, is_main=self.is_main(), broadcast=lambda error: self.comm.broadcast(error, 0)
        )

    def load(self, path: str | os.PathLike[str], *, weights_only: bool = True) -> Any:
        """Read a file written by :meth:`save` (any backend, any world size) onto the CPU."""
        return checkpoint.load(path, weights_only=weights_only)

    def load_state_dict(self, target: nn.Module | Any, state: Mapping[str, Any]) -> None:
        """Load a portable state dict into a (wrapped) model or optimizer."""
        if isinstance(target, nn.Module):
            self.state_io.load_model_state_dict(target, state)
        else:
            self.state_io.load_optimizer_state_dict(target, state)

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full, unwrapped ``state_dict`` (plain names) as CPU tensors.  A
        collective on backends that shard parameters: every rank must call it."""
        return self.state_io.model_state_dict(model)

    def optimizer_state_dict(self, optimizer: Any) -> dict[str, Any] | None:
        """A plain ``torch.optim`` state dict (tensors on the CPU), gathered whole where it is sharded."""
        return self.state_io.optimizer_state_dict(optimizer)

    def named_optimizer_state(self, model: nn.Module, optimizer: Any) -> dict[str, Any]:
        """The optimizer's whole state keyed by ``model``'s parameter names (a collective where it is sharded)."""
        return self.state_io.named_optimizer_state(model, optimizer)

    def load_named_optimizer_state(self, model: nn.Module, optimizer: Any, state: Mapping[str, Any]) -> None:
        """Load what :meth:`named_optimizer_state` gave, by parameter name (any backend, any world size)."""
        self.state_io.load_named_optimizer_state(model, optimizer, state)

    # ---------------------------------------------------------- elastic runs
    def run_elastic(self, train: Any) -> Any:
        """Run ``train()``, again in the new world after a lost rank where the
        launcher can change the world (``horovodrun --min-np --max-np``);
        elsewhere once.  ``train`` builds everything afresh each time and
        resumes from ``parallelx.latest_checkpoint`` (docs/failures.md, "Surviving failures")."""
        self._require_init()
        return self.elastic.run(train)

    def elastic_commit(self) -> None:
        """Mark the checkpoint just saved as where an elastic run goes back to
        (hosts join or leave here).  Every rank calls it; elsewhere a no-op."""
        self._require_init()
        self.elastic.commit()
