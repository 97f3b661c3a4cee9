"""The gradient-synchronisation part of a backend: how each rank's gradients
become the averaged ones, and how the optimizer then steps.

:class:`parallelx.parts.loop.TrainingLoop` drives one optimizer step through it::

    with sync.no_sync():             # every micro-batch but a window's last
        forward
    sync.backward(loss, ...)         # the backend's own backward (DeepSpeed's engine)
    sync.synchronize(optimizer)      # at the boundary: the averaged gradients are in place
    precision.unscale(optimizer)
    sync.clip(optimizer, max_norm)   # the global norm, taken as one process takes it
    sync.apply(optimizer, precision) # the update (skipped together under 16-mixed overflow)

The answers here are those of a backend whose gradients are averaged by
autograd hooks, or need no averaging (one process); ``ddp``, ``fsdp``,
``horovod`` and ``deepspeed`` each give a subclass in their own module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from parallelx.parts.collectives import Collectives
from parallelx.parts.precision import Precision

#: The user's modules a backend set up (unwrapped), in the order they were wrapped.
Models = Callable[[], list[nn.Module]]


def no_models() -> list[nn.Module]:
    return []


def optimizer_params(optimizer: Any) -> list[torch.Tensor]:
    """Every parameter of ``optimizer``, in its groups' order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def model_order(params: Iterable[torch.Tensor], models: Iterable[nn.Module]) -> list[torch.Tensor]:
    """``params`` in the order of ``models``' ``parameters()`` (a parameter
    shared by several modules, such as a tied embedding, where it first
    appears), then any that belong to none of them in their own order.

    ``torch.nn.utils.clip_grad_norm_(model.parameters())`` adds the
    per-parameter norms in this order: the last bits of the global norm
    depend on it, and so, when it clips, does the update."""
    wanted = {id(p): p for p in params}
    ordered: list[torch.Tensor] = []
    seen: set[int] = set()
    for model in models:
        for p in model.parameters():
            if id(p) in wanted and id(p) not in seen:
                seen.add(id(p))
                ordered.append(p)
    ordered += [p for i, p in wanted.items() if i not in seen]
    return ordered


def total_norm(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """The global 2-norm of the gradients of ``params``, as ``get_total_norm`` takes it."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(grads, norm_type=2.0)


def clip_to_norm(params: Iterable[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients by ``max_norm / (norm + 1e-6)`` when that is below 1,
    exactly as ``torch.nn.utils.clip_grad_norm_`` does."""
    with_grad = [p for p in params if p.grad is not None]
    if with_grad:
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, norm)


def parameter_names(models: Iterable[nn.Module]) -> dict[int, str]:
    """Each parameter's name in its model, by ``id``; the second and later
    models' names are prefixed with their position (``"1.weight"``)."""
    names: dict[int, str] = {}
    for i, model in enumerate(models):
        for n, p in model.named_parameters():
            names.setdefault(id(p), f"{i}.{n}" if i else n)
    return names


def owner_names(params: Iterable[torch.Tensor], models: Iterable[nn.Module]) -> dict[int, str]:
    """Each of ``params``' names in the model that holds it (unprefixed when
    one model holds them all, as usual)."""
    wanted = {id(p) for p in params}
    owners = [m for m in models if any(id(p) in wanted for p in m.parameters())]
    return parameter_names(owners)


def summed_per_parameter(comm: Collectives, tensor: torch.Tensor) -> torch.Tensor:
    """The sum over the ranks of one entry per parameter (a gradient norm's squares), in a new tensor.
    Every rank passes the same shape by construction, so without ``Collectives.all_reduce``'s agreement
    on shapes, which would add an all-reduce and a host read of every rank's row to each step."""
    out = tensor.detach().to(comm.comm_device(tensor), copy=True)
    with comm.watch("all_reduce"):
        out = comm.reduce_(out, "sum")
    return out.to(tensor.device)


class GradientSync:
    """Plain autograd: gradients are averaged by the time ``backward`` returns
    (DDP's hooks), or there is nothing to average (one process)."""

    #: Under tensor parallelism, the part that knows which gradients are slices (the norm's sums);
    #: the facade sets it at init().
    tensor_parallel: Any = None

    def __init__(self, models: Models = no_models) -> None:
        #: The unwrapped modules the backend set up (their parameter order is the clipping order).
        self.models = models

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """Keep gradients local for one forward and backward inside a window."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, *, model: nn.Module | None, boundary: bool) -> None:
        """Backpropagate the (already scaled) ``loss``; ``boundary``: the window's last micro-batch."""
        loss.backward()

    def synchronize(self, optimizer: torch.optim.Optimizer) -> None:
        """Make the gradients the averaged ones before they are clipped."""

    def clip(self, optimizer: torch.optim.Optimizer, max_norm: float | None) -> torch.Tensor | None:
        """Clip the averaged gradients to ``max_norm`` (None: only measure);
        return their global norm before clipping, or None when the backend
        takes it inside its step (:meth:`stepped_grad_norm`)."""
        params = model_order(optimizer_params(optimizer), self.models())
        tp = self.tensor_parallel
        norm = total_norm(params) if tp is None else tp.total_norm(params)
        if max_norm is not None:
            clip_to_norm(params, max_norm, norm)
        return norm

    def apply(self, optimizer: torch.optim.Optimizer, precision: Precision) -> bool:
        """Step the optimizer; False when the step was skipped (an inf/nan
        gradient under ``16-mixed``), on every rank together."""
        return precision.step(optimizer)

    def stepped_grad_norm(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """The norm the backend took inside :meth:`apply` (``nan`` when none)."""
        return torch.tensor(float("nan"))

    def averaged_gradients(self, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        """The averaged gradient of each of ``optimizer``'s parameters, whole,
        on the CPU, keyed by parameter name (see :func:`parameter_names`).
        Valid between :meth:`synchronize` and :meth:`apply`; a collective
        where gradients are sharded: every rank calls it."""
        names = owner_names(optimizer_params(optimizer), self.models())
        return self.named_whole(
            [
                (names.get(id(p), f"param{i}"), p, p.grad.detach().to("cpu", torch.float32, copy=True))
                for i, p in enumerate(optimizer_params(optimizer))
                if p.grad is not None
            ]
        )

    def named_whole(self, pairs: list[tuple[str, torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """``(name, parameter, gradient whole over the data-parallel ranks)`` as ``{name: gradient}``;
        under tensor parallelism a split layer's slices put together too (a collective of the group)."""
        if self.tensor_parallel is None:
            return {name: g for name, _, g in pairs}
        return self.tensor_parallel.whole_gradients(pairs)
