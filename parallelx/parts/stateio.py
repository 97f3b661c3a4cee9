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

import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from parallelx.errors import ParallelxError
from parallelx.parts import state as pure
from parallelx.parts.state import to_cpu
from parallelx.storage import Location

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


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` with ``fn`` applied to every tensor in its dicts, lists and tuples (new containers)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [map_tensors(v, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(map_tensors(v, fn) for v in obj)
    return obj


class StateIO:
    """Whole state, on a backend that keeps every tensor whole on every rank."""

    def __init__(self, unwrap: Unwrap) -> None:
        #: The user's module inside the backend's wrappers.
        self.unwrap = unwrap
        # The parameters each set-up optimizer was built on (a backend may swap its groups' own, as
        # ZeRO does for its flat partitions): how a state keyed by name finds the model it names.
        self._built_on: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()

    def remember(self, optimizer: Any, params: Iterable[torch.Tensor]) -> None:
        """``optimizer`` (as set up, and as returned to the script) was built on ``params``."""
        try:
            self._built_on[optimizer] = frozenset(id(p) for p in params)
        except TypeError:  # a wrapper that cannot be weakly referenced: its groups say it at load time
            pass

    def load_optimizer_state(self, optimizer: Any, state: Mapping[str, Any], models: Sequence[nn.Module]) -> None:
        """Load an optimizer state keyed by position (``optimizer.state_dict()``,
        :meth:`optimizer_state_dict`) or by parameter name (``torch.distributed.checkpoint.state_dict.
        get_optimizer_state_dict``, parallelx's ``state.pt``), on any backend.  A state by name is
        checked against the model the optimizer trains (one of ``models``) on every rank alike, then
        loaded by name; what cannot load is a :class:`ParallelxError` naming the key."""
        if not pure.is_named_optimizer_state(state):
            self.load_optimizer_state_dict(optimizer, state)
            return
        model = self._trained_model(optimizer, models)
        module = self.unwrap(model)
        names: list[str] = []
        aliases: dict[str, str] = {}
        first: dict[int, str] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            name = plain_key(name)
            if id(p) in first:
                aliases[name] = first[id(p)]  # a tied weight's later names (torch keys it by the first)
            else:
                first[id(p)] = name
                names.append(name)
        named = pure.named_state_for(state, names, aliases, self.parameter_shapes(module))
        self.load_named_optimizer_state(model, optimizer, named)

    def parameter_shapes(self, module: nn.Module) -> dict[str, tuple[int, ...]]:
        """Each parameter's whole shape (:meth:`whole_shape`) by plain name."""
        return {plain_key(n): self.whole_shape(p) for n, p in module.named_parameters()}

    def whole_shape(self, param: torch.Tensor) -> tuple[int, ...]:
        """A parameter's whole shape; a backend whose parameter tensors are this rank's partition,
        and do not say the whole shape themselves, gives its own."""
        return tuple(param.shape)

    def _trained_model(self, optimizer: Any, models: Sequence[nn.Module]) -> nn.Module:
        built_on = self._built_on.get(optimizer)
        if built_on is None:
            built_on = frozenset(id(p) for g in optimizer.param_groups for p in g["params"])
        owners = [m for m in models if any(id(p) in built_on for p in self.unwrap(m).parameters())]
        if len(owners) == 1:
            return owners[0]
        raise ParallelxError(
            "an optimizer state keyed by parameter name needs the model whose names it holds; "
            + (
                f"{len(owners)} of the models set up hold this optimizer's parameters"
                if owners
                else "this optimizer trains no model set up by this backend"
            )
            + ": write `backend.load_named_optimizer_state(model, optimizer, state)`"
        )

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

    def copy_shards(self, shards: Any, copy: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        """What :meth:`sharded_state` gave, with the memory of every tensor in it replaced by ``copy``'s
        (a plain tensor's whole; a sharded tensor's local part, its global layout kept): an asynchronous
        checkpoint writes these copies in the background while the live tensors train on.  New dicts
        and lists throughout, so no later change of a live one reaches them either."""
        return map_tensors(shards, copy)

    def load_sharded_state(
        self, model: nn.Module, optimizer: Any, directory: Location, saved: Mapping[str, Any]
    ) -> bool:
        """Read this rank's own slices of a sharded checkpoint's ``directory``
        straight into ``model`` and ``optimizer`` (a collective); ``saved``: the
        optimizer's entry in ``state.pt`` (its param groups, and what else
        :meth:`sharded_state` put beside the tensors).  False: the backend does
        not shard, and the caller loads the whole tensors."""
        return False

    def checkpoint_meta(self) -> dict[str, Any]:
        """What a training-state checkpoint records of this backend's set-up
        besides its name and world size (DeepSpeed: its ZeRO stage)."""
        return {}
