"""``bf16-compute`` where the engine has no cast of its own (ddp, horovod, dp on fewer than two GPUs,
single): the forward and the backward run on a bfloat16 copy of the weights, the update on the
float32 weights.

At each forward of the user's module a pre-hook casts every floating parameter to the compute type and
puts the copies in the parameters' places for that forward only (tied weights share one copy), and
casts the floating inputs to it; the forward's hook puts the float32 parameters back and casts the
floating outputs to float32, so that the loss is taken in float32 as FSDP2's
``MixedPrecisionPolicy(output_dtype=float32)`` gives it.  The casts are differentiable: each
parameter's gradient arrives in float32 on the float32 parameter, so DDP and Horovod average
float32 gradients, accumulation sums them in float32, and the optimizer, its state, the weight
average and the checkpoints see float32 weights as under ``32``.

What it cannot carry: activation checkpointing, whose recomputation in the backward runs outside the
forward and would find the float32 weights (refused with the alternatives); ``nn.DataParallel`` over
several GPUs, whose replicas would share the hooks' state across threads (refused: ddp).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_map_only

from parallelx.errors import ParallelxError


def cast_floats(tree: Any, dtype: torch.dtype, source: torch.dtype | None = None) -> Any:
    """``tree`` with its floating tensors (of type ``source`` when given) cast to ``dtype``."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and t.dtype != dtype and (source is None or t.dtype == source):
            return t.to(dtype)
        return t

    return tree_map_only(torch.Tensor, cast, tree)


class ComputeCopy:
    """The hooks on one user module; ``dtype()`` is read at each forward (None: float32 as under ``32``,
    so that ``backend.set_options(precision=...)`` applies to a model already set up)."""

    def __init__(self, module: nn.Module, dtype: Callable[[], torch.dtype | None]) -> None:
        self.dtype = dtype
        self.entered: list[contextlib.ExitStack] = []
        module.register_forward_pre_hook(self.enter, with_kwargs=True)
        module.register_forward_hook(self.leave, always_call=True)

    def enter(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        dtype = self.dtype()
        stack = contextlib.ExitStack()
        self.entered.append(stack)  # one per forward, so that a nested call of the same module unwinds in order
        if dtype is None:
            return args, kwargs
        copies = {name: p.to(dtype) for name, p in module.named_parameters() if p.is_floating_point()}
        stack.enter_context(_reparametrize_module(module, copies, tie_weights=True))
        return cast_floats(args, dtype), cast_floats(kwargs, dtype)

    def leave(self, module: nn.Module, args: Any, output: Any) -> Any:
        if not self.entered:
            return output  # the pre-hook did not run (a pre-hook before it raised)
        self.entered.pop().close()
        dtype = self.dtype()
        return output if dtype is None else cast_floats(output, torch.float32, source=dtype)


def compute_copy(module: nn.Module, dtype: Callable[[], torch.dtype | None], who: str, checkpointing: Any) -> None:
    """Run ``module``'s forward and backward on a copy of its weights in ``dtype()`` (module docstring).
    Nothing is hooked where the model is set up under another precision (``set_options`` applies to the
    models set up afterwards); a hooked model follows a later change away from ``bf16-compute``."""
    if dtype() is None:
        return
    if checkpointing:
        raise ParallelxError(
            f"{who}: --precision bf16-compute casts the weights for each forward only, and activation "
            "checkpointing recomputes blocks in the backward, outside it; use --precision bf16-mixed "
            "(autocast) with activation checkpointing here, or the fsdp backend, whose bf16-compute casts "
            "per unit and recomputes in bfloat16"
        )
    ComputeCopy(module, dtype)


def float32_outputs(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast ``module``'s ``dtype`` outputs to float32, where an engine casts the weights and inputs itself
    (DeepSpeed's ``bf16``): the loss is then taken in float32 as on every backend."""

    def hook(m: nn.Module, args: Any, output: Any) -> Any:
        return cast_floats(output, torch.float32, source=dtype)

    module.register_forward_hook(hook)
