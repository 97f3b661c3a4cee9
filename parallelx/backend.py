"""The ``Backend`` protocol: everything a training script asks of a
distributed-training backend, in one place.

A script written against this class runs unchanged on every backend::

    backend = parallelx.get_backend(args.backend)
    backend.init()
    model, optimizer = backend.setup(model, optimizer)
    sampler = backend.make_sampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=64, sampler=sampler)
    for x, y in loader:
        loss = criterion(model(x.to(backend.device)), y.to(backend.device))
        backend.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    backend.save({"model": model, "optimizer": optimizer}, "ckpt.pth")  # on every rank

Backends subclass :class:`Backend` (or :class:`ProcessGroupBackend` when they
communicate through ``torch.distributed``) in one module each under
``backends/``.  Heavy packages (deepspeed, horovod) are imported only inside
their backend's methods, never at module import.
"""

from __future__ import annotations

import abc
import argparse
import datetime as _dt
import importlib.util
import os
import sys
import tempfile
from collections import deque
from collections.abc import Mapping, Sequence, Sized
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from .errors import LaunchError, ParallelxError
from .sampler import ShardedSampler

ReduceOp = Literal["sum", "mean", "max", "min"]
REDUCE_OPS: tuple[str, ...] = ("sum", "mean", "max", "min")
T = TypeVar("T")

DEFAULT_TIMEOUT_S = 1800.0

# Handles of the most recent torch.distributed collectives, kept until the
# interpreter itself frees them.  Gloo's worker thread drops its reference to a
# finished work after the caller has already returned; when that is the last
# reference, the worker destroys the work's tensors and takes the GIL to do it.
# If the script has meanwhile reached interpreter shutdown, Python ends that
# thread inside a C++ destructor and the process aborts ("terminate called
# without an active exception", exit -6) after all of its work was done.  A
# barrier also holds the works that were still in flight when it started, so
# holding the last few handles here leaves the worker nothing to destroy.
_RECENT_WORK: deque[Any] = deque(maxlen=16)


def default_timeout() -> float:
    """Collective timeout in seconds: ``$PARALLELX_TIMEOUT`` or 30 minutes."""
    raw = os.environ.get("PARALLELX_TIMEOUT")
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ParallelxError(f"PARALLELX_TIMEOUT must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ParallelxError(f"PARALLELX_TIMEOUT must be > 0 seconds, got {value}")
    return value


def check_op(op: str) -> str:
    if op not in REDUCE_OPS:
        raise ParallelxError(f"unknown reduce op {op!r}; expected one of {', '.join(REDUCE_OPS)}")
    return op


class Backend(abc.ABC):
    """Base class of all backends.

    Subclasses must implement :meth:`init`, :meth:`wrap_model`, and the
    collectives when they have more than one process.  The defaults here are
    those of a world of one process.
    """

    #: Registry name, e.g. ``"ddp"``.
    name: ClassVar[str] = ""
    #: The importable package this backend needs, if any, and how to install it.
    requires_module: ClassVar[str | None] = None
    install_hint: ClassVar[str] = ""

    def __init__(self, *, timeout: float | None = None, verbose: bool = True) -> None:
        #: True when the user chose the timeout (argument or $PARALLELX_TIMEOUT),
        #: which then overrides a launcher's own default.
        self.timeout_explicit = timeout is not None or "PARALLELX_TIMEOUT" in os.environ
        self.timeout_s: float = default_timeout() if timeout is None else float(timeout)
        if self.timeout_s <= 0:
            raise ParallelxError(f"timeout must be > 0 seconds, got {self.timeout_s}")
        self.verbose = verbose
        self._initialized = False
        self._rank = 0
        self._world_size = 1
        self._local_rank = 0
        self._local_world_size = 1
        self._device = torch.device("cpu")

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
        timeout = getattr(args, "timeout", None)
        return {} if timeout is None else {"timeout": timeout}

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
    @abc.abstractmethod
    def init(self) -> None:
        """Join the process group (if any) and choose the device.  Call once."""

    def shutdown(self) -> None:
        """Leave the process group.  Safe to call more than once."""
        self._initialized = False

    def __enter__(self) -> Backend:
        if not self._initialized:
            self.init()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _limit_cpu_threads(self, local_world_size: int) -> None:
        """On the CPU, give each of the ``local_world_size`` processes on this
        machine its share of the cores: torch's default (all cores in every
        process) oversubscribes them and slows every rank down.  An explicit
        ``OMP_NUM_THREADS`` from the user or the launcher is left alone."""
        if self.device.type == "cpu" and local_world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
            from .utils import threads_per_process

            torch.set_num_threads(threads_per_process(local_world_size))

    def _require_init(self) -> None:
        if not self._initialized:
            raise ParallelxError(f"backend {self.name!r} is not initialised: call backend.init() first")

    # --------------------------------------------------------- model set-up
    @abc.abstractmethod
    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to :attr:`device` and wrap it for this backend."""

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> Any:
        """Wrap ``optimizer`` (built on the model's parameters) for this backend."""
        return optimizer

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> tuple[nn.Module, Any]:
        """Wrap model and optimizer together.  Prefer this over the two
        separate calls: some backends (DeepSpeed) can only build both at once.
        Returns ``(model, optimizer)``; the optimizer is None when none was given."""
        self._require_init()
        wrapped = self.wrap_model(model)
        return wrapped, (self.wrap_optimizer(optimizer) if optimizer is not None else None)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's original module inside whatever wrapper the backend added."""
        while hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        return model

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` (DeepSpeed must see it; others call ``loss.backward()``)."""
        loss.backward()

    # ----------------------------------------------------------------- data
    def make_sampler(self, dataset: Sized, *, shuffle: bool = True, seed: int = 0,
                     drop_last: bool = False) -> ShardedSampler:
        """A sampler giving this rank its shard of ``dataset``.  The shards of all
        ranks are disjoint and cover the dataset (padded to equal length; see
        :class:`ShardedSampler` for masking the padding out of metrics).  The
        shuffle changes every epoch without any ``set_epoch`` call."""
        return ShardedSampler(dataset, num_replicas=self.world_size, rank=self.rank,
                              shuffle=shuffle, seed=seed, drop_last=drop_last)

    # ---------------------------------------------------------- collectives
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Reduce ``tensor`` over all ranks and return the result (a new tensor,
        on ``tensor``'s device; the input is left unchanged).  ``mean`` of an
        integer tensor is returned as float."""
        check_op(op)
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

    def _reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """Reduce ``tensor`` (``sum``, ``max`` or ``min``) over all ranks; may work
        in place.  A world of one has nothing to reduce."""
        return tensor

    def barrier(self) -> None:
        """Wait until every rank reaches this point."""

    def broadcast(self, obj: T, src: int = 0) -> T:
        """Return rank ``src``'s ``obj`` on every rank.  Tensors are sent as
        tensors (same shape and dtype on every rank); anything else is pickled."""
        return obj

    # ---------------------------------------------------------- checkpoints
    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full, unwrapped ``state_dict`` as CPU tensors.  A collective on
        backends that shard parameters: every rank must call it."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.unwrap(model).state_dict().items()}

    def optimizer_state_dict(self, optimizer: Any) -> dict[str, Any] | None:
        """A plain ``torch.optim`` state dict (tensors on the CPU), or None with a
        warning when the backend keeps it in a form that cannot be made portable."""
        return _to_cpu(optimizer.state_dict())

    def portable(self, obj: Any) -> Any:
        """``obj`` with every model and optimizer replaced by its plain state dict.
        A collective: every rank must call it with the same structure."""
        if isinstance(obj, nn.Module):
            return self.model_state_dict(obj)
        if _is_optimizer(obj):
            return self.optimizer_state_dict(obj)
        if isinstance(obj, Mapping):
            return {k: self.portable(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.portable(v) for v in obj)
        return obj

    def save(self, obj: Any, path: str | os.PathLike[str]) -> None:
        """Write ``obj`` to one plain PyTorch file that ``torch.load`` reads
        without any backend package.  **Every rank must call this** (gathering
        sharded state is collective); only the main rank writes.  ``obj`` is a
        model or a dict whose values may be models, optimizers, tensors and
        plain Python values.  The write is atomic: a failure leaves any
        previous file intact, and raises on every rank."""
        state = self.portable(obj)
        error: str | None = None
        if self.is_main():
            try:
                atomic_save(state, Path(path))
            except Exception as exc:  # reported to every rank below
                error = f"saving {path} failed on rank 0: {type(exc).__name__}: {exc}"
        # The broadcast doubles as the barrier: no rank moves on before the file exists.
        error = self.broadcast(error, src=0)
        if error is not None:
            raise ParallelxError(error)

    def load(self, path: str | os.PathLike[str], *, weights_only: bool = True) -> Any:
        """Read a checkpoint written by :meth:`save` (by any backend, at any world
        size) onto the CPU.  Every rank reads the file."""
        p = Path(path)
        if not p.is_file():
            raise ParallelxError(f"checkpoint {p} does not exist")
        return torch.load(p, map_location="cpu", weights_only=weights_only)

    def load_state_dict(self, target: nn.Module | Any, state: Mapping[str, Any]) -> None:
        """Load a portable state dict into a (wrapped) model or optimizer."""
        if isinstance(target, nn.Module):
            self.unwrap(target).load_state_dict(state)
        else:
            target.load_state_dict(state)


class ProcessGroupBackend(Backend):
    """A backend whose processes talk through ``torch.distributed``
    (Gloo on the CPU, NCCL on GPUs)."""

    def _init_process_group(self) -> None:
        """Join the default process group from the launcher's environment."""
        if dist.is_initialized():
            return
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise LaunchError(f"{self.name}: environment lacks {', '.join(missing)}; "
                              "start the script with its launcher")
        dist.init_process_group(backend=self._dist_backend(), timeout=_dt.timedelta(seconds=self.timeout_s))

    def _dist_backend(self) -> str:
        # NCCL for a process that has its own GPU (see _pick_device), else Gloo.
        return "nccl" if self.device.type == "cuda" else "gloo"

    def _pick_device(self) -> torch.device:
        # NCCL needs one GPU per process; fall back to the CPU when there are too few.
        if torch.cuda.is_available() and torch.cuda.device_count() > self.local_rank:
            torch.cuda.set_device(self.local_rank)
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    def _comm_device(self, tensor: torch.Tensor) -> torch.device:
        # NCCL only reduces CUDA tensors; Gloo reduces CPU ones (and CUDA ones).
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def _reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        self._require_init()
        red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        _wait(dist.all_reduce(tensor, op=red, async_op=True))
        return tensor

    def barrier(self) -> None:
        self._require_init()
        _wait(dist.barrier(async_op=True))

    def broadcast(self, obj: T, src: int = 0) -> T:
        self._require_init()
        if isinstance(obj, torch.Tensor):
            out = obj.detach().to(self._comm_device(obj), copy=True)
            _wait(dist.broadcast(out, src=src, async_op=True))
            return out.to(obj.device)  # type: ignore[return-value]
        box = [obj]
        dist.broadcast_object_list(box, src=src, device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        super().shutdown()


# ---------------------------------------------------------------- helpers
def _wait(work: Any) -> None:
    """Wait for an ``async_op=True`` collective and keep its handle (see _RECENT_WORK)."""
    work.wait()
    _RECENT_WORK.append(work)


def _is_optimizer(obj: Any) -> bool:
    return isinstance(obj, torch.optim.Optimizer) or (
        callable(getattr(obj, "state_dict", None)) and hasattr(obj, "param_groups"))


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, Mapping):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file beside ``path``, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def warn(msg: str) -> None:
    print(f"parallelx: warning: {msg}", file=sys.stderr, flush=True)
