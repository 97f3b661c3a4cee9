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
import importlib.util
import os
import random
from collections.abc import Iterator, Mapping, Sequence, Sized
from typing import Any, ClassVar, Literal, TypeVar

import numpy as np
import torch
from torch import nn

from . import checkpoint, log
from .errors import ParallelxError
from .launch import PYTHON, Launcher
from .sampler import ShardedSampler

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

    def __init__(self, *, timeout: float | None = None, device: str | torch.device | None = None,
                 verbose: bool = True) -> None:
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
                self._shutdown(failed=False)
            finally:
                self._initialized = False
                atexit.unregister(self.abort)

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
        with keep_rng_state():
            return self._wrap_model(model)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Wrap ``optimizer`` (built on the parameters of a model already passed
        to :meth:`wrap_model`).  The result is a ``torch.optim.Optimizer``: LR
        schedulers built on it afterwards work on every backend."""
        self._require_init()
        with keep_rng_state():
            return self._wrap_optimizer(optimizer)

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

    def backward(self, loss: torch.Tensor, *, model: nn.Module | None = None) -> None:
        """Backpropagate ``loss``.  ``model`` names the wrapped model the loss
        trains; only needed by backends whose backward belongs to a model
        (DeepSpeed) when several models are set up."""
        loss.backward()

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

    # ---------------------------------------------------------- checkpoints
    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full, unwrapped ``state_dict`` as CPU tensors.  A collective on
        backends that shard parameters: every rank must call it."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.unwrap(model).state_dict().items()}

    def optimizer_state_dict(self, optimizer: Any) -> dict[str, Any] | None:
        """A plain ``torch.optim`` state dict (tensors on the CPU), or None with a
        warning when the backend keeps it in a form that cannot be made portable."""
        return checkpoint.to_cpu(optimizer.state_dict())

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
