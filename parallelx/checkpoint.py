"""Checkpoint IO: portable state, atomic writes, reads.

A parallelx checkpoint is one plain PyTorch file: every model is replaced by
its unwrapped ``state_dict`` and every optimizer by a plain ``torch.optim``
state dict, all on the CPU, so ``torch.load(path, weights_only=True)`` reads it
anywhere, with no backend package and at any world size.  Gathering sharded
state is the backend's business (``Backend.model_state_dict`` and
``Backend.optimizer_state_dict``); this module only walks, writes and reads.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import state as pure
from .errors import ParallelxError
from .state import to_cpu


def is_optimizer(obj: Any) -> bool:
    """A torch optimizer, or anything shaped like one (a backend's wrapper)."""
    return isinstance(obj, torch.optim.Optimizer) or (
        callable(getattr(obj, "state_dict", None)) and hasattr(obj, "param_groups")
    )


def portable(obj: Any, model_state: Callable[[nn.Module], Any], optimizer_state: Callable[[Any], Any]) -> Any:
    """``obj`` with models and optimizers replaced by what the two functions return.
    Walks dicts, lists and tuples; the order of the walk is the same on every
    rank, which matters when the functions are collectives."""
    if isinstance(obj, nn.Module):
        return model_state(obj)
    if is_optimizer(obj):
        return optimizer_state(obj)
    if isinstance(obj, Mapping):
        return {k: portable(v, model_state, optimizer_state) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(portable(v, model_state, optimizer_state) for v in obj)
    return obj


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save`` to a temporary file beside ``path``, then rename it into
    place: a failure (or a crash) leaves any previous file intact."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(path: str | os.PathLike[str], *, weights_only: bool = True) -> Any:
    """Read a checkpoint onto the CPU; a missing or unreadable file is one clear error."""
    p = Path(path)
    if not p.is_file():
        raise ParallelxError(f"checkpoint {p} does not exist")
    try:
        return torch.load(p, map_location="cpu", weights_only=weights_only)
    except Exception as exc:  # truncated, not a torch file, pickled objects refused by weights_only
        raise ParallelxError(
            f"checkpoint {p} cannot be read ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else 'no detail'})"
        ) from None


def save_on_main(
    state: Any, path: str | os.PathLike[str], *, is_main: bool, broadcast: Callable[[str | None], str | None]
) -> None:
    """Rank 0 writes ``state`` atomically; every rank returns once the file
    exists, or raises the same error (``broadcast`` sends rank 0's word to
    every rank and doubles as the barrier)."""
    error: str | None = None
    if is_main:
        try:
            atomic_save(state, path)
        except Exception as exc:  # reported to every rank below
            error = f"saving {path} failed on rank 0: {type(exc).__name__}: {exc}"
    error = broadcast(error)
    if error is not None:
        raise ParallelxError(error)


class StateHooks:
    """How a backend hands out and takes back whole state: ``Backend`` inherits
    these plain answers, and a backend that shards parameters or optimizer
    state (DeepSpeed's ZeRO) overrides them with its gathering and scattering.
    :meth:`Backend.save` and the training-state checkpoints
    (:mod:`parallelx.trainstate`) ask only these."""

    def unwrap(self, model: nn.Module) -> nn.Module:  # Backend's
        raise NotImplementedError

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full, unwrapped ``state_dict`` as CPU tensors.  A collective on
        backends that shard parameters: every rank must call it."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.unwrap(model).state_dict().items()}

    def optimizer_state_dict(self, optimizer: Any) -> dict[str, Any] | None:
        """A plain ``torch.optim`` state dict (tensors on the CPU), or None with a
        warning when the backend keeps it in a form that cannot be made portable."""
        return to_cpu(optimizer.state_dict())

    def named_optimizer_state(self, model: nn.Module, optimizer: Any) -> dict[str, Any]:
        """The optimizer's whole state in ``torch.optim``'s layout keyed by
        ``model``'s parameter names, on the CPU.  A collective where it is sharded."""
        names = {id(p): n for n, p in self.unwrap(model).named_parameters()}
        return pure.named_optimizer_state(optimizer, names)

    def load_named_optimizer_state(self, model: nn.Module, optimizer: Any, state: Mapping[str, Any]) -> None:
        """Load what :meth:`named_optimizer_state` returned (any backend, any
        world size), matching parameters by name.  Every rank calls it."""
        names = {id(p): n for n, p in self.unwrap(model).named_parameters()}
        pure.load_named_optimizer_state(optimizer, names, state)

    def sharded_state(self, model: nn.Module, optimizer: Any) -> dict[str, Any] | None:
        """This rank's shards of the model's and the optimizer's state by name
        (``{"model": ..., "optimizer": {"state": ..., "param_groups": ...}}``)
        when the backend writes sharded training-state checkpoints
        (:mod:`parallelx.sharded`); None: whole tensors in ``state.pt``."""
        return None

    def load_sharded_state(
        self, model: nn.Module, optimizer: Any, directory: Path, param_groups: list[dict[str, Any]]
    ) -> bool:
        """Read this rank's own slices of a sharded checkpoint's ``directory``
        straight into ``model`` and ``optimizer`` (a collective); False: the
        backend does not shard, and the caller loads the whole tensors."""
        return False

    def checkpoint_meta(self) -> dict[str, Any]:
        """What a training-state checkpoint records of this backend's set-up
        besides its name and world size (DeepSpeed: its ZeRO stage)."""
        return {}
