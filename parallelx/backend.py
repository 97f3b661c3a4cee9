"""``Backend``: what a training script calls, on every backend (``recipes/example.py`` shows the loop).

``Backend`` is a facade that nobody subclasses.  It holds a :class:`~parallelx.strategy.Strategy`
(one per module under ``backends/``: how that backend joins its world and wraps models) and the
parts the strategy built, each a small class with public methods of its own:

========================  ==============================================  ===========================
part                      what it does                                    attribute
========================  ==============================================  ===========================
collectives               reduce, broadcast, barrier, gather              ``backend.comm``
gradient synchronisation  no-sync windows, backward, the boundary         ``backend.grad_sync``
                          reduce, clipping's norm, the step
precision                 autocast, loss scale, skipped steps             ``backend.precision``
state in and out          whole or sharded model and optimizer state     ``backend.state_io``
the loop                  windows, equal batch counts, the boundary step  ``backend.loop``
environment               where the ranks come from                       ``backend.environment``
watchdog                  ends a rank whose peer stalled                  ``backend.run.watchdog``
elastic                   runs again in a new world after a lost rank     ``backend.elastic``
monitor                   trackers, throughput and MFU, profiles          ``backend.monitor``
========================  ==============================================  ===========================

The facade and its strategy share one :class:`~parallelx.strategy.Run`: the options, the world
joined, the models set up.  Watchers such as ``python -m parallelx check``'s probe attach as
:class:`Observer` objects named by ``$PARALLELX_OBSERVERS`` (``module:function``, comma-separated),
so nothing here knows them.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib
import os
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from typing import Any, Generic, TypeVar, final

import torch
from torch import nn

from parallelx import log
from parallelx.bigmodels.meta import has_meta
from parallelx.bigmodels.meta import prepare as prepare_meta
from parallelx.errors import LaunchError, ParallelxError
from parallelx.forensics import exchange as forensics
from parallelx.forensics import record
from parallelx.launching.environments import ClusterEnvironment, detect_environment
from parallelx.observability import Monitor, MonitorOptions
from parallelx.parts import gather, portable
from parallelx.parts.collectives import Collectives
from parallelx.parts.elastic import Elastic
from parallelx.parts.gradsync import GradientSync
from parallelx.parts.loop import LoopOptions, StepResult, TrainingLoop
from parallelx.parts.mesh import Mesh
from parallelx.parts.precision import FirstStepCheck, Precision
from parallelx.parts.sampler import ShardedSampler
from parallelx.parts.state import keep_rng_state
from parallelx.parts.stateio import StateIO
from parallelx.parts.watchdog import Watchdog
from parallelx.settings import (  # noqa: F401  (DEFAULT_TIMEOUT_S, DEVICES, REDUCE_OPS, default_timeout: documented here too)
    DEFAULT_TIMEOUT_S,
    DEVICES,
    REDUCE_OPS,
    ReduceOp,
    default_timeout,
    limit_cpu_threads,
)
from parallelx.strategy import Joined, Options, Run, Strategy, unwrap
from parallelx.tensor_parallel.checkpoints import TensorParallelStateIO
from parallelx.tensor_parallel.part import TensorParallel
from parallelx.transforms import activations, buffers
from parallelx.transforms.compiling import CompileOptions, uncompiled
from parallelx.utils import has_batchnorm, plain_tensor

T = TypeVar("T")

#: Watchers of a run, as ``module:function`` names (``function(backend)`` returns an :class:`Observer` or None).
OBSERVERS_ENV = "PARALLELX_OBSERVERS"


class Observer:
    """Watches a run's set-up without changing it (``python -m parallelx check``'s probe is one).
    Every method here does nothing; an observer overrides what it needs."""

    @property
    def virtual_ranks(self) -> int:
        """A world size the script should see instead of the real one (the check's one-process
        reference plays N ranks); 0: the real one."""
        return 0

    def before_wrap(self, model: nn.Module) -> None:
        """The model as the script built it, before any broadcast."""

    def wrapped_model(self, wrapped: nn.Module) -> None:
        """The model as ``wrap_model`` returns it."""

    def wrapped_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def made_sampler(self, sampler: ShardedSampler, dataset: Sized) -> ShardedSampler:
        return sampler

    def made_average(self, average: Any) -> None:
        """A weight average (:class:`parallelx.EMA`) made beside a model set up on this backend."""

    def finish(self) -> None:
        """At ``shutdown()``: every rank is there, so a collective is safe."""


class Flag:
    """``backend.is_main``: a bool that may also be called, so ``if backend.is_main:`` and
    ``if backend.is_main():`` both mean what they say (a bound method is always true)."""

    __slots__ = ("_value",)

    def __init__(self, value: bool) -> None:
        self._value = value

    def __bool__(self) -> bool:
        return self._value

    def __call__(self) -> bool:
        return self._value

    def __eq__(self, other: object) -> bool:
        return bool(self) == other

    def __hash__(self) -> int:
        return hash(self._value)

    def __repr__(self) -> str:
        return repr(self._value)


class Batches(Generic[T]):
    """What ``backend.batches(loader)`` returns: an iterable with a length where the loader has one,
    so a progress bar or a logger can size itself from it."""

    def __init__(self, iterate: Callable[[], Iterator[T]], length: int | None) -> None:
        self._iterate = iterate
        self._length = length

    def __iter__(self) -> Iterator[T]:
        return self._iterate()

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError("this loader has no length, so neither have its batches")
        return self._length


@final
class Backend:
    """What a training script calls, on every backend.  Made by :func:`parallelx.get_backend` or
    :func:`parallelx.from_args`; not subclassed (a backend is a :class:`~parallelx.strategy.Strategy`)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        raise ParallelxError(
            f"{cls.__name__}: parallelx.Backend is the facade users call and is not subclassed; a backend is a "
            "parallelx.Strategy subclass (its hooks return the world, the parts and the wrapped model), "
            "registered with parallelx.register_backend(name, MyStrategy)"
        )

    def __init__(self, strategy: Strategy, options: Options | None = None) -> None:
        if not isinstance(strategy, Strategy):
            raise ParallelxError(
                f"parallelx.Backend takes a backend's Strategy, not {type(strategy).__name__} {strategy!r}: for a "
                f"backend by name write `parallelx.get_backend({strategy!r})` (options as keywords, e.g. "
                "`timeout=60`), or `parallelx.from_args(args)` after `parallelx.add_arguments(parser)`"
                if isinstance(strategy, str)
                else f"parallelx.Backend takes a backend's Strategy, not {type(strategy).__name__}: write "
                "`parallelx.get_backend(name)`"
            )
        options = options or Options()
        spec = strategy.spec
        #: The strategy this facade runs (``backends/<name>.py``).
        self.strategy = strategy
        self.run = run = Run(spec.name, options)
        if run.cpu_offload and not spec.offloads:
            raise ParallelxError(
                f"{spec.name}: cpu_offload keeps sharded state in CPU memory; {spec.name} keeps whole copies on the "
                "device: use --backend fsdp, or deepspeed with --zero-stage 1 to 3"
            )
        run.options = strategy.bind(run)
        run.precision = self._make_precision()
        self.state_io: StateIO = strategy.state_io()
        # Parts the strategy replaces at init(); until then a world of one.
        self.grad_sync: GradientSync = GradientSync(run.models)
        self.elastic: Elastic = Elastic()
        #: The tensor-parallel part under ``tensor_parallel=N`` (None otherwise; set at init()).
        self.tensor_parallel: TensorParallel | None = None
        #: Trackers, throughput and profiles (:mod:`parallelx.observability`); the loop marks its steps for it.
        self.monitor = Monitor(
            run, MonitorOptions.make(options.monitor, loggers=options.loggers, log_dir=options.log_dir)
        )
        self.loop: TrainingLoop | None = None
        self._buffer_sync = buffers.BufferSync(lambda t: self.comm.broadcast(t, src=0), run.models)
        # The parameters of the set-up models before and after wrapping (an optimizer may be built on either).
        self._known_params: dict[int, weakref.ref[torch.Tensor]] = {}
        self._observers: list[Observer] = []
        self._virtual_ranks = 0
        # A precision asked for and never entered is said once, after the first step (docs/loops.md, "Precision").
        self._first_step = FirstStepCheck(spec.name, lambda: self.run.precision, run.models)

    # ------------------------------------------------------------------ info
    @property
    def name(self) -> str:
        """Registry name, e.g. ``"ddp"``."""
        return self.strategy.spec.name

    @property
    def rank(self) -> int:
        """Global rank of this process among the data-parallel processes."""
        return self.run.joined.rank if self.run.joined is not None else 0

    @property
    def world_size(self) -> int:
        """Number of data-parallel processes (1 for ``single`` and ``dp``)."""
        if self._virtual_ranks > 1:
            return self._virtual_ranks
        return self.run.joined.world_size if self.run.joined is not None else 1

    @property
    def local_rank(self) -> int:
        """Rank of this process on its machine."""
        return self.run.joined.local_rank if self.run.joined is not None else 0

    @property
    def local_world_size(self) -> int:
        """Number of this job's processes on this machine (to share its CPUs)."""
        return self.run.joined.local_world_size if self.run.joined is not None else 1

    @property
    def mesh(self) -> Mesh:
        """Where this process stands in the data-parallel x tensor-parallel grid
        (:mod:`parallelx.parts.mesh`): ``data_rank``/``data_size`` are the coordinates to shard and seed
        data by under ``--tensor-parallel``; without it, the rank and the world size."""
        mesh = self.run.mesh
        if mesh is not None and mesh.tensor_parallel and self.initialized:
            return mesh
        # The world as the script sees it (python -m parallelx check's virtual ranks included).
        return Mesh.whole(self.rank, self.world_size, mesh.data_comm if mesh is not None else None)

    @property
    def device(self) -> torch.device:
        """Where this process puts its inputs: ``cuda:<local_rank>`` or ``cpu``."""
        return self.run.device

    @property
    def initialized(self) -> bool:
        return self.run.joined is not None

    @property
    def comm(self) -> Collectives:
        """The collectives part (reduce, broadcast, barrier, gather)."""
        return self.run.comm

    @property
    def environment(self) -> ClusterEnvironment | None:
        """Where this process's rank and world come from: given, or detected by init()."""
        return self.run.environment

    @property
    def options(self) -> LoopOptions:
        """The loop options in force (:class:`parallelx.parts.loop.LoopOptions`); :meth:`set_options` changes them."""
        return self.run.options

    @property
    def precision(self) -> Precision:
        """Everything ``precision`` changes (:class:`parallelx.parts.precision.Precision`)."""
        return self.run.precision

    @property
    def observers(self) -> tuple[Observer, ...]:
        """The observers attached at init() (``$PARALLELX_OBSERVERS``)."""
        return tuple(self._observers)

    @property
    def is_main(self) -> Flag:
        """True on exactly one process (global rank 0); ``if backend.is_main:`` and
        ``if backend.is_main():`` both work."""
        return Flag(self.rank == 0)

    @property
    def is_local_main(self) -> Flag:
        """True on one process per machine (local rank 0)."""
        return Flag(self.local_rank == 0)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        if self.rank == 0:
            print(*args, **kwargs, flush=True)

    def __repr__(self) -> str:
        return (
            f"Backend(name={self.name!r}, rank={self.rank}, world_size={self.world_size}, device={str(self.device)!r})"
        )

    # ------------------------------------------------------------ lifecycle
    def init(self) -> Backend:
        """Join the world (if any) and choose the device.  A second call does nothing.
        Returns the backend, so ``backend = get_backend("ddp").init()`` reads well."""
        if self.initialized:
            return self
        run, spec = self.run, self.strategy.spec
        env = run.environment = run.environment or detect_environment()
        if run.tensor_parallel_size > 1 and not spec.tensor_parallel:
            raise ParallelxError(
                f"{spec.name} cannot split layers over ranks (--tensor-parallel {run.tensor_parallel_size}): "
                "tensor parallelism runs on fsdp (2D: tensor parallel inside, FSDP2 sharding over the data-parallel "
                "ranks), ddp (DDP over the data-parallel ranks) and deepspeed at ZeRO 0-2: start the same script "
                f"with `torchrun --nproc-per-node N ... --backend fsdp --tensor-parallel {run.tensor_parallel_size}`, "
                "or leave --tensor-parallel out (docs/tensor-parallel.md)"
            )
        if spec.environments is not None and env.name not in spec.environments:
            raise LaunchError(
                f"{spec.name} cannot form its world under {env.name} ({env.why()}); it runs under "
                f"{', '.join(spec.environments)}: start it with `{spec.launcher.usage()} --backend "
                f"{spec.name} ...`{env.hint()}"
            )
        log.set_rank(env.world().rank)  # from here on, warnings come from rank 0 only (parallelx.log)
        if spec.needs_watchdog:
            run.watchdog = Watchdog(run.timeout_s, env.world().rank)
        with keep_rng_state():
            joined = self.strategy.join()
            if joined.comm.rank != joined.rank or joined.comm.world_size != joined.world_size:
                raise ParallelxError(
                    f"{spec.name}: join() returned rank {joined.rank} of {joined.world_size} but collectives for "
                    f"rank {joined.comm.rank} of {joined.comm.world_size}"
                )
            run.joined = joined
            run.mesh = self.strategy.make_mesh()
            self.grad_sync = self.strategy.gradient_sync()
            self.elastic = self.strategy.elastic()
        if run.mesh.tensor_parallel:
            self.tensor_parallel = TensorParallel(
                run.mesh, sequence_parallel=run.sequence_parallel, plan=run.tp_plan, loss_parallel=run.loss_parallel
            )
            run.on_shutdown.append(self.tensor_parallel.close)
            self.grad_sync.tensor_parallel = self.tensor_parallel
            if not isinstance(self.state_io, TensorParallelStateIO):
                self.state_io = TensorParallelStateIO(self.state_io, self.tensor_parallel)
        if run.watchdog is not None and joined.world_size == 1:
            run.watchdog = None  # nobody to wait for
        log.set_rank(self.rank)
        limit_cpu_threads(self.device, self.local_world_size)
        if run.cpu_offload and self.device.type != "cuda":
            self.abort()
            raise ParallelxError(
                f"{spec.name}: --cpu-offload moves sharded state from the GPU's memory to the CPU's; this process "
                f"already runs on {self.device}: leave it out here"
            )
        try:
            run.precision = self._make_precision()  # on the device now known (16-mixed needs CUDA)
        except ParallelxError as exc:
            self.abort()
            raise ParallelxError(f"{spec.name}: {exc}") from None
        loop = self.loop = TrainingLoop(spec.name, self.grad_sync, joined.comm, run.watch, run, self.monitor)
        if self.tensor_parallel is not None and run.sequence_parallel:
            loop.add_boundary_hook(self.tensor_parallel.finish_gradients)
        run.on_rejoin[:] = [self._rejoined]
        self._observers = [o for o in (make(self) for make in observers_from_environment()) if o is not None]
        self._virtual_ranks = max([o.virtual_ranks for o in self._observers], default=0)
        # Every rank's record compared on a timeout or an error (parallelx.forensics, docs/hangs.md).
        forensics.start(
            self.rank,
            self.world_size,
            run.timeout_s,
            lambda obj: joined.comm.broadcast(obj, 0),
            stacks_dir=run.stacks_dir,
        )
        # A script that ends without shutdown() (it raised, or forgot) still
        # releases the process group before the interpreter is torn down, while
        # the threads of its communication library can still take the GIL.
        atexit.register(self.abort)
        return self

    def shutdown(self) -> None:
        """Leave the world and release what the backend holds.  Every rank calls
        it at the end of a successful run.  Safe to call more than once."""
        if self.initialized:
            for finish in list(self.run.on_shutdown):  # e.g. a checkpoint written in the background completes
                finish()
            for observer in self._observers:  # every rank is here: an observer's collectives are safe
                observer.finish()
            try:
                with self.run.watch("shutdown"):
                    self.monitor.close()  # the last metrics (a collective when reduced), the trackers closed
                    self.strategy.shutdown(failed=False)
            finally:
                forensics.stop()
                self.run.joined = None
                atexit.unregister(self.abort)
                if self.run.watchdog is not None:
                    self.run.watchdog.close()

    def abort(self) -> None:
        """Release what this process holds without waiting for the other ranks
        (they may be dead or stuck): for the error path.  Safe to call more than once."""
        if self.initialized:
            # Unless __exit__ has already: the error that ends the script, for the other ranks' verdict.
            forensics.report_failure(getattr(sys, "last_value", None))
            forensics.stop()
            try:
                self.monitor.close(failed=True)
                self.strategy.shutdown(failed=True)
            except Exception as exc:  # the error that brought us here matters more
                log.warn(f"{self.name}: releasing the backend after a failure raised {type(exc).__name__}: {exc}")
            finally:
                self.run.joined = None

    def __enter__(self) -> Backend:
        return self.init()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, *tb: object) -> None:
        if exc_type is None:
            self.shutdown()
        else:
            forensics.report_failure(exc)
            self.abort()

    def _require_init(self) -> TrainingLoop:
        if self.loop is None or not self.initialized:
            raise ParallelxError(
                f"backend {self.name!r} is not initialised: call backend.init() (or use `with backend:`) first"
            )
        return self.loop

    def _make_precision(self) -> Precision:
        made = self.strategy.precision_class(self.run.options.precision, self.device if self.initialized else None)
        made.entered = self.run.precision.entered  # the script's autocast() before this part was made again
        return made

    # --------------------------------------------------------- model set-up
    # Templates: a backend's own work runs with the random generators saved and
    # restored, so whatever its set-up draws cannot shift the user's dropout
    # masks, shuffles or augmentations: the same numbers on every backend.
    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to :attr:`device` and wrap it for this backend."""
        self._require_init()
        run = self.run
        buffers.warn_if_per_process(model, self.world_size)
        model, compiled = uncompiled(model)
        if compiled and not run.compile_options.enabled:
            log.warn(
                f"{self.name}: the model was compiled before setup; parallelx compiles it again the way {self.name} "
                "needs, after wrapping (mode default; --compile-mode chooses another)"
            )
            run.compile_options = CompileOptions(enabled=True)
        meta = has_meta(model)
        if meta:  # built under parallelx.init_module(): each tensor computed where this backend keeps it
            # A plain torch.device("meta") build draws its reset_parameters' random numbers now, outside
            # keep_rng_state: the generator moves as the eager build moved it.
            prepare_meta(model, self.name)
        if self.tensor_parallel is not None and meta:  # cut first: each rank then computes only its slices
            with keep_rng_state():
                self.tensor_parallel.apply(model, self.device, self.name)
        if meta:
            with keep_rng_state():
                self.strategy.materialize(model)
        known = list(model.parameters())
        for observer in self._observers:  # the initial weights, before any broadcast
            observer.before_wrap(model)
        if self.tensor_parallel is not None and not meta:  # the split layers first: the engine wraps what they became
            with keep_rng_state():
                self.tensor_parallel.apply(model, self.device, self.name)
        checkpointing = run.activation_checkpointing
        if checkpointing is not None and checkpointing is not False:
            activations.apply(model, None if isinstance(checkpointing, bool) else checkpointing)
        with keep_rng_state():
            wrapped = self.strategy.wrap_model(model)
            if run.compile_options.enabled:
                self.strategy.compile(wrapped)
        module = unwrap(wrapped)
        if self.tensor_parallel is not None:
            self.tensor_parallel.track(module)  # the engine's parameter objects (FSDP2 makes new ones)
            self.tensor_parallel.guard(module, self.run.timeout_s)  # after the engine's own check, if it has one
        self._known_params = {i: ref for i, ref in self._known_params.items() if ref() is not None}
        self._known_params.update((id(p), weakref.ref(p)) for p in [*known, *module.parameters()])
        run.add_model(module)
        for observer in self._observers:
            observer.wrapped_model(wrapped)
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
            wrapped = self.strategy.wrap_optimizer(optimizer)
        # The parameters as given and as the wrapped optimizer holds them: fsdp moves an optimizer built
        # before setup onto its sharded parameters, and a name-keyed state finds its model by either.
        live = [p for group in wrapped.param_groups for p in group["params"]]
        self.state_io.remember(wrapped, [*params, *live])
        self._first_step.watch(wrapped)
        if self.world_size > 1:  # rank 0's buffers on every rank after each step (parallelx.transforms.buffers)
            self._buffer_sync.attach([*params, *live], wrapped)
        for observer in self._observers:
            wrapped = observer.wrapped_optimizer(wrapped)
        self.state_io.remember(wrapped, [*params, *live])
        return wrapped

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
        return unwrap(model)

    # --------------------------------------------------------- the training loop
    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """``torch.autocast`` to the ``precision``'s dtype (nothing for ``32``), for the forward and the loss."""
        return self.precision.autocast()

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """The loss scaler of ``16-mixed`` (None otherwise, or when the backend scales by itself)."""
        return self.precision.scaler

    def batches(self, loader: Iterable[T], *, limit: int | None = None) -> Batches[T]:
        """The batches of ``loader`` (at most ``limit``), in windows of
        ``accumulate`` micro-batches with no gradient exchange inside one; the
        same number on every rank (see :class:`parallelx.parts.loop.TrainingLoop`).
        Its ``len()`` is the loader's (or ``limit``, if smaller) where the loader has one."""
        self._require_init()
        length: int | None = None
        if isinstance(loader, Sized):
            length = len(loader) if limit is None else min(limit, len(loader))
        return Batches(lambda: self._require_init().batches(loader, limit), length)

    def backward(self, loss: torch.Tensor, *, model: nn.Module | None = None) -> None:
        """Backpropagate ``loss`` (this micro-batch's mean), divided once by the
        window's length.  Several calls before one :meth:`step` add up, as
        ``loss.backward()`` does; a loss through several models' parameters
        gives each of them gradients, as autograd does.  ``model`` names the
        model whose engine runs the backward, where a backend has one per
        model (DeepSpeed; by default the first the loss reaches)."""
        self._require_init().backward(loss, model)

    def step(self, optimizer: torch.optim.Optimizer, scheduler: Any = None) -> StepResult | None:
        """None inside a window; at its end: average, unscale, clip, step the
        optimizer and ``scheduler`` (not after a skipped step), zero the
        gradients of exactly this optimizer's parameters, and return the
        :class:`~parallelx.parts.loop.StepResult`.  Other models' gradients
        (a loss through them) stay until the script zeroes them or steps
        their optimizer, as in plain PyTorch (docs/loops.md, "Several models
        and optimizers")."""
        return self._require_init().step(optimizer, scheduler)

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
        run = self.run
        old = run.options
        options = self.strategy.configure(dataclasses.replace(run.options, **changes))
        run.options = options
        try:
            precision = self._make_precision() if self.initialized else run.precision
        except ParallelxError as exc:
            run.options = old
            raise ParallelxError(f"{self.name}: {exc}") from None
        run.precision = precision
        self.strategy.options_changed(options)
        return options

    # ----------------------------------------------------------------- data
    def make_sampler(
        self, dataset: Sized, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False
    ) -> ShardedSampler:
        """This rank's shard of ``dataset``: disjoint shards that cover it, padded
        to equal length (``MetricSums`` leaves the padding out); a new shuffle
        every epoch without ``set_epoch``."""
        mesh = self.mesh  # the data-parallel coordinates: a tensor-parallel group reads one shard
        sampler = ShardedSampler(
            dataset, num_replicas=mesh.data_size, rank=mesh.data_rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        for observer in self._observers:
            sampler = observer.made_sampler(sampler, dataset)
        return sampler

    # ---------------------------------------------------------- collectives
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Reduce ``tensor`` over all ranks into a new tensor on its device (the
        input is left unchanged); ``mean`` of an integer tensor is a float."""
        self._require_init()
        return self.comm.all_reduce(plain_tensor(tensor), op)

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
        return gather.gather_rows(self.comm, plain_tensor(tensor))[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's (picklable) ``obj``, as a list indexed by rank.  A collective."""
        self._require_init()
        return gather.all_gather_object(self.comm, obj)

    def gather_in_order(self, tensor: torch.Tensor, sampler: ShardedSampler) -> torch.Tensor:
        """The per-sample rows of one whole pass of ``sampler`` from every rank,
        in dataset order (row ``i`` is sample ``i``), padding left out.  Call it
        after the pass, before the next one starts.  A collective."""
        self._require_init()
        comm = self.mesh.data_comm or self.comm  # one tensor-parallel group's rows once
        return gather.gather_in_order(comm, plain_tensor(tensor), sampler)

    # ---------------------------------------------------- synchronised BatchNorm
    def sync_batchnorm(self, model: nn.Module) -> nn.Module:
        """``model`` with BatchNorm over the global batch in training; call it
        before :meth:`wrap_model`.  Unchanged in a world of one process."""
        self._require_init()
        if not has_batchnorm(model):
            return model
        with keep_rng_state():
            model = self.strategy.sync_batchnorm(model)
        if self.world_size > 1:
            buffers.mark_global_statistics(model)
        return model

    # ------------------------------------------------ checkpoints (the state part)
    def portable(self, obj: Any) -> Any:
        """``obj`` with every model and optimizer replaced by its plain state dict.
        A collective: every rank must call it with the same structure."""
        return portable.portable(obj, self.state_io.model_state_dict, self.state_io.optimizer_state_dict)

    def save(self, obj: Any, path: str | os.PathLike[str]) -> None:
        """Write ``obj`` (a model, or a dict of models, optimizers, tensors and
        plain values) to one plain PyTorch file.  **Every rank calls it**
        (gathering sharded state is collective); rank 0 writes, atomically; a
        failure leaves any previous file intact and raises on every rank."""
        self._require_init()
        with record.call("save", "gathering the state"):
            portable.save_on_main(
                self.portable(obj), path, is_main=self.rank == 0, broadcast=lambda error: self.comm.broadcast(error, 0)
            )

    def load(self, path: str | os.PathLike[str], *, weights_only: bool = True) -> Any:
        """Read a file written by :meth:`save` (any backend, any world size) onto the CPU."""
        return portable.load(path, weights_only=weights_only)

    def load_state_dict(self, target: nn.Module | Any, state: Mapping[str, Any]) -> None:
        """Load a portable state dict into a (wrapped) model or optimizer.  An optimizer's state may be
        keyed by position (``optimizer.state_dict()``) or by parameter name (torch's
        ``get_optimizer_state_dict``, parallelx's ``state.pt``); every rank calls it."""
        if isinstance(target, nn.Module):
            self.state_io.load_model_state_dict(target, state)
        else:
            self.state_io.load_optimizer_state(target, state, self.run.models())

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
    def _rejoined(self, new: Joined) -> None:
        """An elastic reset (Horovod's, in this process): everything that holds the world's rank and
        size follows the new world, whose ranks may be fewer and renumbered.  Every rank calls it."""
        run = self.strategy.run
        if self.loop is not None:
            self.loop.comm = new.comm
        # The mesh's data-parallel collectives are what metrics and gathers reduce over: the old
        # world's would sum a rank that is gone (an elastic world has no tensor parallelism).
        run.mesh = self.strategy.make_mesh()
        log.set_rank(new.rank)
        forensics.stop()  # its store and world were the old world's
        forensics.start(
            new.rank, new.world_size, run.timeout_s, lambda obj: new.comm.broadcast(obj, 0), stacks_dir=run.stacks_dir
        )

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


def observers_from_environment(environ: Mapping[str, str] | None = None) -> list[Callable[[Backend], Observer | None]]:
    """The observer factories ``$PARALLELX_OBSERVERS`` names (``module:function``, comma-separated)."""
    spec = (os.environ if environ is None else environ).get(OBSERVERS_ENV, "")
    found = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        module, _, attr = item.partition(":")
        try:
            found.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError) as exc:
            raise ParallelxError(f"${OBSERVERS_ENV} names {item!r}, which does not import: {exc}") from None
    return found
