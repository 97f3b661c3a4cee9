"""Activation checkpointing on every backend: the chosen units keep only their
inputs in the forward and compute their activations again in the backward.

Non-reentrant ``torch.utils.checkpoint.checkpoint`` (reentrant checkpointing
and DDP conflict unless DDP's graph is static), with the random-number state
saved and restored, so dropout draws the same masks again and the weights
equal those of the same run without checkpointing, to the bit.  The units are
chosen as for ``fsdp``'s sharding (:mod:`parallelx.transforms.units`): ``auto`` (the same
blocks) or class names.  Applied before any wrapping (``fully_shard``,
``torch.compile``), as torchtitan does; the module keeps its type and its
``state_dict`` names: only its ``forward`` is replaced.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from parallelx.transforms.units import UnitPolicy, select_units

#: Set on a module whose forward is checkpointed (a second application would nest them).
MARK = "_parallelx_checkpointed"


def checkpoint_forward(module: nn.Module) -> None:
    """Replace ``module``'s forward by one that recomputes its activations in the backward."""
    if getattr(module, MARK, False):
        return
    forward = module.forward

    @functools.wraps(forward)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing is kept anyway
            return forward(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed
    setattr(module, MARK, True)


def apply(model: nn.Module, policy: UnitPolicy) -> list[nn.Module]:
    """Checkpoint the units ``policy`` chooses in ``model``; returns them."""
    units = select_units(model, policy, who="activation checkpointing")
    for unit in units:
        checkpoint_forward(unit)
    return units
