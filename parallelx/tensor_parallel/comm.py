"""The collectives inside a split layer's forward and backward, as autograd functions.

Megatron-LM's pair, over the tensor-parallel group: a column-wise layer reads the
whole input on every rank (:func:`copy_in`: nothing in the forward, the input's
gradient summed over the group in the backward, since each rank computed it from
its slice of the weight only); a row-wise layer's partial products are summed
(:func:`reduce_out`: an all-reduce in the forward, nothing in the backward).
Sequence parallelism trades them for an all-gather and a reduce-scatter along
the sequence (:func:`gather_sequence`, :func:`scatter_sequence`), and cuts and
joins the sequence where the blocks begin and end (:func:`split_sequence`,
:func:`join_sequence`).

The parameters stay plain tensors, each rank's slice: any data-parallel engine
(DDP over the data-parallel group, FSDP2 over its mesh) wraps them as it wraps
any other parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["copy_in", "gather_sequence", "join_sequence", "reduce_out", "scatter_sequence", "split_sequence"]


#: A collective over ``group`` along ``dim``.
Op = Callable[[torch.Tensor, Any, int], torch.Tensor]


def _all_reduce(t: torch.Tensor, group: Any) -> torch.Tensor:
    out = t.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def _all_gather(t: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(t: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    chunks = [c.contiguous() for c in t.chunk(size, dim=dim)]
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter(out, chunks, group=group)
    return out


def _own_chunk(t: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    return t.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)].contiguous()


class _CopyIn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Sequence(torch.autograd.Function):
    """One collective along the sequence in the forward, its partner in the backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int, there: Op, back: Op) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.back = group, dim, back
        return there(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return ctx.back(grad, ctx.group, ctx.dim), None, None, None, None


def copy_in(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` as it is; in the backward its gradient summed over ``group``."""
    return _CopyIn.apply(x, group)


def reduce_out(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` summed over ``group``; its gradient passed through."""
    return _ReduceOut.apply(x, group)


def gather_sequence(x: torch.Tensor, group: Any, dim: int = 1) -> torch.Tensor:
    """Every rank's sequence chunk put together; in the backward the gradient reduce-scattered."""
    return _Sequence.apply(x, group, dim, _all_gather, _reduce_scatter)


def join_sequence(x: torch.Tensor, group: Any, dim: int = 1) -> torch.Tensor:
    """Every rank's sequence chunk put together for a region every rank computes alike (after the
    last block): in the backward each rank keeps its chunk of the (equal) gradient."""
    return _Sequence.apply(x, group, dim, _all_gather, _own_chunk)


def scatter_sequence(x: torch.Tensor, group: Any, dim: int = 1) -> torch.Tensor:
    """The partial sums reduced and this rank's sequence chunk kept; in the backward all-gathered."""
    return _Sequence.apply(x, group, dim, _reduce_scatter, _all_gather)


def split_sequence(x: torch.Tensor, group: Any, dim: int = 1) -> torch.Tensor:
    """This rank's chunk of a whole (replicated) ``x``; in the backward the chunks' gradients put together."""
    return _Sequence.apply(x, group, dim, _own_chunk, _all_gather)
