"""The state part of a backend: model and optimizer state out (whole, portable)
and back in.

:meth:`Backend.save`, the training-state checkpoints
(:mod:`parallelx.checkpoints.trainstate`) and sharded checkpoints (:mod:`parallelx.checkpoints.sharded`)
ask only this part.  The answers here are those of a backend that keeps every
tensor whole on every rank; a backend that shards parameters or optimizer
state (``fsdp``, DeepSpeed's ZeRO) gives a subclass that gathers and scatters.

Portable state has plain names: no wrapper's prefix (DDP's ``module.``) and
no ``torch.compile`` prefix (``_orig_mod.``, which a compiled module or
submodule adds to every key), so a checkpoint loads into the plain model on
any backend, compiled or not.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallelx.parts import state as pure
from parallelx.parts.state import to_cpu

#: The prefix ``torch.compile`` gives the keys of a compiled module (its ``OptimizedModule._orig_mod``).
COMPILED_PREFIX = "_orig_mod."

Unwrap = Callable[[nn.Module], nn.Module]


def plain_key(key: str) -> str:
    """``key`` without any ``_orig_mod.`` segment (``block._orig_mod.weight`` -> ``block.weight``)."""
    if COMPILED_PREFIX not in key:
        return key
    return ".".join(part for part in key.split(".") if part != COMPILED_PREFIX[:-1])


def plain_keys(state: Mapping[str, Any]) -> dict[str, Any]:
    """A state dict with :func:`plain_key` names."""
    return {plain_key(k): v for k, v in state.items()}


def keyed_like(state: Mapping[str, Any], module: nn.Module) -> dict[str, Any]:
    """``state`` (plain names) with the names ``module``'s own ``state_dict``
    uses, where compiled submodules add ``_orig_mod.``; other keys as given."""
    live = {plain_key(k): k for k in module.state_dict()}
    return {live.get(k, k): v for k, v in state.items()}


def named_parameters(module: nn.Module) -> dict[int, str]:
    """Each parameter's plain name (no ``_orig_mod.``), by ``id``."""
    return {id(p): plain_key(n) for n, p in module.named_parameters()}


class StateIO:
    """Whole state, on a backend that keeps every tensor whole on every rank."""

    def __init__(self, unwrap: Unwrap) -> None:
        #: The user's module inside the backend's wrappers.
        self.unwrap = unwrap

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full, unwrapped ``state_dict`` with plain names, as CPU tensors.
        A collective on backends that shard parameters: every rank calls it."""
        return {plain_key(k): v.detach().to("cpu", copy=True) for k, v in self.unwrap(model).state_dict().items()}

    def load_model_state_dict(self, model: nn.Module, state: Mapping[str, Any]) -> None:
        """Load a portable model state (any backend, any world size) into ``model``."""
        module = self.unwrap(model)
        module.load_state_dict(keyed_like(state, module))

    def optimizer_state_dict(self, optimizer: Any) -> dict[str, Any] | None:
        """A plain ``torch.optim`` state dict (tensors on the CPU)."""
        return to_cpu(optimizer.state_dict())

    def load_optimizer_state_dict(self, optimizer: Any, state: Mapping[str, Any]) -> None:
        """Load what :meth:`optimizer_state_dict` gave (positions, in group order)."""
        optimizer.load_state_dict(state)

    def named_optimizer_state(self, model: nn.Module, optimizer: Any) -> dict[str, Any]:
        """The optimizer's whole state in ``torch.optim``'s layout keyed by
        ``model``'s parameter names, on the CPU.  A collective where it is sharded."""
        return pure.named_optimizer_state(optimizer, named_parameters(self.unwrap(model)))

    def load_named_optimizer_state(self, model: nn.Module, optimizer: Any, state: Mapping[str, Any]) -> None:
        """Load what :meth:`named_optimizer_state` gave (any backend, any world
        size), matching parameters by name.  Every rank calls it."""
        pure.load_named_optimizer_state(optimizer, named_parameters(self.unwrap(model)), state)

    def sharded_state(self, model: nn.Module, optimizer: Any) -> dict[str, Any] | None:
        """This rank's shards of the model's and the optimizer's state by name
        (``{"model": ..., "optimizer": {"state": ..., "param_groups": ...}}``)
        when the backend writes sharded training-state checkpoints
        (:mod:`parallelx.checkpoints.sharded`); None: whole tensors in ``state.pt``."""
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
