"""What a backend author writes: a :class:`Strategy`, described by a :class:`BackendSpec`.

Users never see a strategy: they call :class:`parallelx.Backend`, the facade,
which holds one.  A strategy's hooks *return* what they build (the world it
joined, its parts, the wrapped model) and read what the run has chosen from the
:class:`Run` the facade shares with it; nothing else of the facade is theirs::

    class MyStrategy(ProcessGroupStrategy):          # parallelx.strategies
        spec = BackendSpec(name="mine", summary="...", launcher=TORCHRUN)

        def wrap_model(self, model):
            return MyWrapper(model.to(self.run.device))

    parallelx.register_backend("mine", MyStrategy)   # or the parallelx.backends entry-point group

``backends/<name>.py`` holds one strategy each; ``parallelx/strategies/`` the
bases they share (a world of one process; a ``torch.distributed`` process group).
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import dataclasses
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from parallelx.bigmodels.estimate import ModelCounts, RankMemory, Training, layout
from parallelx.bigmodels.export import Layout, whole_tensors
from parallelx.bigmodels.meta import materialize
from parallelx.errors import ParallelxError
from parallelx.forensics import record
from parallelx.launching.environments import ClusterEnvironment
from parallelx.launching.launchers import PYTHON, Launcher
from parallelx.observability import MonitorOptions
from parallelx.parts.collectives import Collectives
from parallelx.parts.elastic import Elastic
from parallelx.parts.gradsync import GradientSync
from parallelx.parts.loop import LoopOptions
from parallelx.parts.mesh import Mesh
from parallelx.parts.precision import Precision
from parallelx.parts.shards import ParameterShards
from parallelx.parts.stateio import StateIO
from parallelx.parts.watchdog import Watchdog
from parallelx.settings import check_device, check_timeout, common_options, default_timeout, pick_device
from parallelx.transforms.batchnorm import SyncBatchNorm, convert_batchnorm
from parallelx.transforms.compiling import CompileOptions, compile_in_place
from parallelx.transforms.units import UnitPolicy
from parallelx.utils import missing_package

__all__ = ["BackendSpec", "Joined", "Options", "Run", "Strategy"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackendSpec:
    """A backend as the registry, the launchers and ``python -m parallelx env`` see it: a record, no behaviour."""

    #: Registry name, e.g. ``"ddp"``.
    name: str
    #: One line for tables: what runs under this backend.
    summary: str = ""
    #: How this backend's processes are started (see :mod:`parallelx.launching.launchers`).
    launcher: Launcher = PYTHON
    #: The importable package this backend needs, if any, and how to install it.
    requires_module: str | None = None
    install_hint: str = ""
    #: Python code that ``python -m parallelx env`` runs in a fresh process to check that the
    #: package really works; it prints one line of detail.
    probe_code: str | None = None
    #: The cluster environments (:mod:`parallelx.launching.environments`) this backend can form its
    #: world in; None: it ignores them (a world of one process).
    environments: tuple[str, ...] | None = None
    #: True for backends whose collectives can wait forever for a stalled peer: the facade then
    #: watches their blocking calls (:mod:`parallelx.parts.watchdog`).
    needs_watchdog: bool = False
    #: True for backends that can keep sharded state in CPU memory between uses (``cpu_offload=True``).
    offloads: bool = False
    #: True for backends that split layers over ranks (``tensor_parallel=N``): their strategy's
    #: :meth:`Strategy.make_mesh` builds the data-parallel x tensor-parallel grid and their engine wraps
    #: over its data-parallel part (:mod:`parallelx.tensor_parallel`).
    tensor_parallel: bool = False

    def unavailable_reason(self) -> str | None:
        """Why this backend cannot run here, or None (its package is not imported to find out)."""
        return missing_package(self.requires_module, self.install_hint)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """Everything a run chooses that every backend understands (``parallelx.get_backend(name, **options)``
    and ``parallelx.from_args`` build one).  A backend's own options (a ZeRO stage, fsdp's units) go to its
    strategy's constructor instead."""

    #: Seconds a collective may wait (default ``$PARALLELX_TIMEOUT``, else 1800).
    timeout: float | None = None
    #: A folder where each rank writes its Python stack when the ranks part ways (``--dump-stacks``;
    #: default ``$PARALLELX_DUMP_STACKS``, else none).
    dump_stacks: str | os.PathLike[str] | None = None
    #: ``auto``, ``cpu`` or ``cuda`` (``cuda:<local_rank>`` for each process).
    device: str | torch.device | None = None
    verbose: bool = True
    #: The loop (:class:`parallelx.parts.loop.LoopOptions`).
    accumulate: int = 1
    clip_grad_norm: float | None = None
    precision: str = "32"
    grad_compression: str = "none"
    #: ``torch.compile`` as each backend needs it (:mod:`parallelx.transforms.compiling`).
    compile: bool | str | CompileOptions = False
    #: Which units recompute their activations in the backward: None, True (the default units) or a policy.
    activation_checkpointing: bool | UnitPolicy | None = None
    #: Sharded state kept in CPU memory between uses (fsdp, ZeRO 1-3 on GPUs).
    cpu_offload: bool = False
    #: Ranks that split each layer (tensor parallelism, :mod:`parallelx.tensor_parallel`): the world
    #: becomes (world / N) data-parallel x N tensor-parallel ranks.  1: none.
    tensor_parallel: int = 1
    #: Between the split layers, each rank keeps a chunk of the sequence (needs ``tensor_parallel`` > 1).
    sequence_parallel: bool = False
    #: The output head's logits stay in vocabulary shards (a ``DTensor``) and the script's
    #: ``F.cross_entropy`` runs on them (needs ``tensor_parallel`` > 1).
    loss_parallel: bool = False
    #: Which layers split how (module-name patterns -> ``colwise``/``rowwise``/``replicate``); None: the
    #: model's own ``tp_plan``, else the default plan (:mod:`parallelx.tensor_parallel.plan`).
    tp_plan: Mapping[str, str] | None = None
    #: Where the ranks come from; None: detected at ``init()``.
    environment: ClusterEnvironment | None = None
    #: Trackers, throughput and profiles (:mod:`parallelx.observability`).
    loggers: str | Sequence[str] | None = None
    log_dir: str | os.PathLike[str] | None = None
    monitor: MonitorOptions | Mapping[str, Any] | None = None

    @classmethod
    def fields(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls))

    def loop_options(self) -> LoopOptions:
        return LoopOptions(
            accumulate=self.accumulate,
            clip_grad_norm=self.clip_grad_norm,
            precision=self.precision,
            grad_compression=self.grad_compression,
        )


@dataclasses.dataclass(frozen=True)
class Joined:
    """What :meth:`Strategy.join` returns: where this process stands, and how it talks to the others."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    comm: Collectives


class Run:
    """What the facade and its strategy share, held once: the run's choices, the world joined,
    the loop options in force and the models set up so far."""

    def __init__(self, name: str, options: Options) -> None:
        self.name = name
        #: True when the user chose the timeout (argument or $PARALLELX_TIMEOUT), which then
        #: overrides a launcher's own default.
        self.timeout_explicit = options.timeout is not None or "PARALLELX_TIMEOUT" in os.environ
        self.timeout_s: float = (
            default_timeout() if options.timeout is None else check_timeout(float(options.timeout), "timeout")
        )
        self.device_request: str = check_device(options.device)
        #: Where each rank's stack goes at a verdict (None: ``$PARALLELX_DUMP_STACKS`` or nowhere).
        self.stacks_dir = options.dump_stacks or None
        self.verbose = options.verbose
        self.cpu_offload = bool(options.cpu_offload)
        self.tensor_parallel_size = int(options.tensor_parallel)
        self.sequence_parallel = bool(options.sequence_parallel)
        self.loss_parallel = bool(options.loss_parallel)
        self.tp_plan = dict(options.tp_plan) if options.tp_plan else None
        if self.tensor_parallel_size < 1:
            raise ParallelxError(f"{name}: tensor_parallel must be at least 1, got {options.tensor_parallel}")
        if self.loss_parallel and self.tensor_parallel_size == 1:
            raise ParallelxError(
                f"{name}: --loss-parallel computes the loss on the output head's vocabulary shards: it needs "
                "--tensor-parallel N (N > 1)"
            )
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            raise ParallelxError(
                f"{name}: --sequence-parallel shards the activations between tensor-parallel layers: it needs "
                "--tensor-parallel N (N > 1)"
            )
        #: Where this process stands in the data-parallel x tensor-parallel grid (set at init()).
        self.mesh: Mesh | None = None
        #: Whether and how models are compiled; wrapping a model compiled by the user turns it on.
        self.compile_options = CompileOptions.of(options.compile)
        self.activation_checkpointing: UnitPolicy | bool = options.activation_checkpointing or None
        #: The loop options in force (``backend.set_options`` replaces them), and the precision part
        #: made from them (the facade makes it: on the device once it is known).
        self.options: LoopOptions = options.loop_options()
        self.precision: Precision = Precision(self.options.precision, None)
        #: Where the ranks come from: given, or detected at init().
        self.environment: ClusterEnvironment | None = options.environment
        self.joined: Joined | None = None
        #: Told when the world changes under a running job (an elastic reset); the facade's loop listens.
        self.on_rejoin: list[Callable[[Joined], None]] = []
        #: Called on every rank at a successful shutdown, first (collectives allowed): what a part
        #: above the facade must finish before the world is left (a checkpoint still being written).
        self.on_shutdown: list[Callable[[], None]] = []
        self.watchdog: Watchdog | None = None
        # The user's modules set up so far, weakly (an elastic run builds new ones).
        self._models: list[weakref.ref[nn.Module]] = []

    # ----------------------------------------------------------- the world
    @property
    def world(self) -> Joined:
        if self.joined is None:
            raise ParallelxError(
                f"backend {self.name!r} is not initialised: call backend.init() (or use `with backend:`) first"
            )
        return self.joined

    @property
    def device(self) -> torch.device:
        return self.joined.device if self.joined is not None else torch.device("cpu")

    @property
    def comm(self) -> Collectives:
        return self.world.comm

    def rejoin(self, joined: Joined) -> None:
        """The world after an elastic reset (a strategy's elastic part calls it)."""
        self.joined = joined
        for listener in self.on_rejoin:
            listener(joined)

    def pick_device(self, index: int) -> torch.device:
        """The device for a process that may use GPU ``index`` (:func:`parallelx.settings.pick_device`)."""
        return pick_device(self.device_request, index, self.name)

    def watch(self, what: str) -> contextlib.AbstractContextManager[Any]:
        """The watchdog (when the backend needs one) armed around a blocking call, which the rank's
        record of its collectives keeps (:mod:`parallelx.forensics.record`)."""
        return record.watched(
            what, self.watchdog.watch(what) if self.watchdog is not None else contextlib.nullcontext()
        )

    # ----------------------------------------------------------- the models
    def models(self) -> list[nn.Module]:
        """The user's modules set up so far that are still alive, in order (the one list of them)."""
        return [m for ref in self._models if (m := ref()) is not None]

    def add_model(self, module: nn.Module) -> None:
        self._models = [ref for ref in self._models if ref() is not None]
        self._models.append(weakref.ref(module))


def unwrap(model: nn.Module) -> nn.Module:
    """The user's original module inside whatever wrapper a backend added (and inside ``torch.compile``'s)."""
    while True:
        inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        if not isinstance(inner, nn.Module):
            inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


class Strategy(abc.ABC):
    """How one backend joins its world and wraps models: one subclass per module under ``backends/``.

    The facade calls the hooks in this order: :meth:`configure` (at construction), :meth:`state_io`,
    then at ``init()`` :meth:`join`, :meth:`gradient_sync` and :meth:`elastic`; :meth:`wrap_model`,
    :meth:`compile` and :meth:`wrap_optimizer` at each set-up; :meth:`shutdown` at the end.
    """

    #: The backend as the registry sees it.
    spec: ClassVar[BackendSpec]
    #: The precision part; an engine that casts and scales by itself gives a variant.
    precision_class: ClassVar[type[Precision]] = Precision

    #: The run this strategy serves, shared with the facade (set by :meth:`bind`).
    run: Run

    @property
    def name(self) -> str:
        return self.spec.name

    # ------------------------------------------------------------ command line
    @classmethod
    def detect(cls, environ: Mapping[str, str], argv: Sequence[str]) -> int:
        """For third-party backends: how strongly the environment asks for this one (0: not at
        all; the cluster environment's choice stands)."""
        return 0

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add this backend's own command-line options (called for every backend, so a script
        accepts all of them whichever backend runs)."""

    @classmethod
    def options_from_args(cls, args: argparse.Namespace) -> dict[str, Any]:
        """Options for :func:`parallelx.get_backend` from parsed command-line args: the common ones and
        this backend's own (the registry hands each to the :class:`Options` or to the constructor)."""
        return common_options(args)

    @classmethod
    def ignored_elsewhere(cls, options: Mapping[str, Any]) -> list[str]:
        """What running without ``options`` (this backend's own, passed to another backend, which
        ignores them) changes in the update, each with the option that asks every backend for it
        (said as a warning by :func:`parallelx.get_backend`).  This default: nothing."""
        return []

    @classmethod
    def estimate_memory(cls, model: ModelCounts, world_size: int, training: Training) -> list[RankMemory]:
        """What each rank would hold training ``model`` under this backend (``python -m parallelx
        estimate``), one row per variant (DeepSpeed: each ZeRO stage), built with
        :func:`parallelx.bigmodels.estimate.layout`.  This default: everything whole on every rank."""
        return [layout(cls.spec.name, model, world_size, training)]

    # ------------------------------------------------------------ the hooks
    def bind(self, run: Run) -> LoopOptions:
        """Take the run (once, at the facade's construction) and return the loop options this backend
        will honour: ``run.options`` unchanged, adjusted (an engine's config file), or refused."""
        self.run = run
        return self.configure(run.options)

    def configure(self, options: LoopOptions) -> LoopOptions:
        """Reject loop options this backend cannot honour; return the ones it runs with.  Called at
        construction and again by ``backend.set_options``."""
        return options

    def state_io(self) -> StateIO:
        """The state part: model and optimizer state in and out (plain names, gathered where sharded)."""
        return StateIO(unwrap)

    @abc.abstractmethod
    def join(self) -> Joined:
        """Join the world of :attr:`Run.environment` and return where this process stands."""

    def gradient_sync(self) -> GradientSync:
        """The gradient part (no-sync windows, the boundary's averaging, clipping's norm, the step)."""
        return GradientSync(self.run.models)

    def elastic(self) -> Elastic:
        """The elastic part: ``train()`` again in a new world where the launcher can change it."""
        return Elastic()

    def make_mesh(self) -> Mesh:
        """The mesh part (:mod:`parallelx.parts.mesh`), after :meth:`join`: here the world itself, every
        rank its own data.  A backend with ``spec.tensor_parallel`` builds the grid of
        ``run.tensor_parallel_size`` instead."""
        world = self.run.world
        return Mesh.whole(world.rank, world.world_size, world.comm)

    def materialize(self, model: nn.Module) -> None:
        """Give a model built under :func:`parallelx.init_module` (its tensors on the meta device) its
        weights, in place, before :meth:`wrap_model`: here every tensor, on the run's device, one at a
        time (one copy per process).  A sharding backend keeps only its slices instead."""
        materialize(model, self.run.device, who=self.name)

    def weight_pieces(self, model: nn.Module) -> Layout:
        """A wrapped model's weights for :func:`parallelx.save_pretrained`: every tensor's name, shape
        and dtype, and the runs of elements this rank writes (here rank 0 writes every tensor whole; a
        sharding backend has each rank write the elements it keeps, nothing gathered)."""
        return whole_tensors(unwrap(model), self.run.world.rank)

    @abc.abstractmethod
    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to the device and wrap it; the facade applied activation checkpointing first."""

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Wrap an optimizer built on the parameters of a model already wrapped.  Its ``step()``
        runs torch's step pre-hooks once the gradients are the averaged ones the update uses (a
        backend that averages inside ``step`` runs them after that): ``python -m parallelx check``
        reads the gradients there."""
        return optimizer

    def parameter_shards(self, model: nn.Module) -> ParameterShards:
        """A wrapped model's parameters as this rank holds them (what :class:`parallelx.EMA` averages):
        whole here; a backend that shards parameters returns this rank's slices."""
        return ParameterShards(unwrap(model))

    def compile(self, wrapped: nn.Module) -> None:
        """Compile a wrapped model as this backend needs (:mod:`parallelx.transforms.compiling`): here, in place."""
        compile_in_place(wrapped, self.run.compile_options)

    def sync_batchnorm(self, model: nn.Module) -> nn.Module:
        """BatchNorm over the global batch; this one reduces through the collectives on any device
        (backends with a native GPU one use theirs there)."""
        world = self.run.world
        if world.world_size == 1:
            return model
        return convert_batchnorm(model, SyncBatchNorm, reduce=lambda t: world.comm.all_reduce(t, "sum"))

    def options_changed(self, options: LoopOptions) -> None:
        """Rebuild whatever the backend derived from the loop options (``backend.set_options``)."""

    def shutdown(self, *, failed: bool) -> None:
        """Release what the backend holds; ``failed`` means: do not talk to other ranks."""


#: A strategy class, or its factory.
StrategyFactory = Callable[..., Strategy]
