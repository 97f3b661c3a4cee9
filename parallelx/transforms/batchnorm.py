"""Synchronised BatchNorm for any backend, through ``Backend.all_reduce``.

``torch.nn.SyncBatchNorm`` (and Horovod's) run on GPUs only: on the CPU
torch's raises in the first training forward.  :class:`SyncBatchNorm` here
normalises with the statistics of the global batch by reducing three small
per-channel sums (sum, sum of squares, count) in the forward and the two
gradient sums in the backward, so that its output and input gradient are
those of one process on the concatenated batch.  The weight and bias
gradients stay local, as in torch's: the backend averages them like any
other parameter's.  :meth:`parallelx.Backend.sync_batchnorm` chooses it
where the backend has nothing native.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

#: Sums a tensor over all ranks and returns the result.
Reduce = Callable[[torch.Tensor], torch.Tensor]


class _SyncBatchNormFunction(torch.autograd.Function):
    # The sums are taken in float64: the variance as E[x^2] - E[x]^2 cancels
    # badly in float32 when the mean is large beside the spread.
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, reduce: Reduce
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        channels, dims = x.shape[1], [0, *range(2, x.dim())]
        shape = [1, channels] + [1] * (x.dim() - 2)
        x64 = x.detach().double()
        count = torch.full((1,), x.numel() // channels, dtype=torch.float64, device=x.device)
        stats = reduce(torch.cat([x64.sum(dims), (x64 * x64).sum(dims), count]))
        total = stats[-1]
        mean = stats[:channels] / total
        var = (stats[channels:-1] / total - mean * mean).clamp_min(0)
        invstd = (var + eps).rsqrt()
        y = (x64 - mean.view(shape)) * invstd.view(shape)
        if weight is not None:
            y = y * weight.detach().double().view(shape)
        if bias is not None:
            y = y + bias.detach().double().view(shape)
        ctx.save_for_backward(x, weight, mean, invstd, total)
        ctx.reduce, ctx.has_bias = reduce, bias is not None
        ctx.mark_non_differentiable(mean, var, total)
        return y.to(x.dtype), mean, var, total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:
        x, weight, mean, invstd, total = ctx.saved_tensors
        channels, dims = x.shape[1], [0, *range(2, x.dim())]
        shape = [1, channels] + [1] * (x.dim() - 2)
        g64, xmu = grad.double(), x.double() - mean.view(shape)
        local = torch.cat([g64.sum(dims), (g64 * xmu).sum(dims)])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:  # the same on every rank: all of them reduce, or none
            sums = ctx.reduce(local)
            sum_dy, sum_dy_xmu = sums[:channels] / total, sums[channels:] / total
            scale = invstd if weight is None else invstd * weight.detach().double()
            grad_x = (
                (g64 - sum_dy.view(shape) - xmu * (invstd * invstd * sum_dy_xmu).view(shape)) * scale.view(shape)
            ).to(x.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = (local[channels:] * invstd).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = local[:channels].to(grad.dtype)
        return grad_x, grad_w, grad_b, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the global batch in training (any input with a channel
    dimension 1, as ``nn.BatchNorm1d/2d/3d`` take); in evaluation it uses the
    running statistics like any BatchNorm.  Its ``state_dict`` is that of the
    layer it replaced.  Every rank must run each training forward and backward."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        *,
        reduce: Reduce,
        **factory: Any,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, **factory)
        self.reduce = reduce

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected an input of at least 2 dimensions (batch, channels, ...), got {input.dim()}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(input)
        self._check_input_dim(input)
        out, mean, var, total = _SyncBatchNormFunction.apply(input, self.weight, self.bias, self.eps, self.reduce)
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            with torch.no_grad():  # as _BatchNorm does: momentum None means a cumulative average
                tracked = self.num_batches_tracked
                assert tracked is not None  # track_running_stats keeps the count
                tracked.add_(1)
                factor = 1.0 / float(tracked) if self.momentum is None else self.momentum
                unbiased = var * (total / (total - 1).clamp_min(1))
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        return out


def convert_batchnorm(module: nn.Module, cls: type[_BatchNorm], **extra: Any) -> nn.Module:
    """``module`` with every BatchNorm layer that is not a ``cls`` already
    replaced by ``cls(num_features, eps, momentum, affine, track_running_stats,
    **extra)``, which takes over the layer's parameters (the same objects: an
    optimizer built on them still holds them), buffers and mode.  Returns
    ``module`` itself unless it is a BatchNorm layer."""
    if isinstance(module, _BatchNorm) and not isinstance(module, cls):
        new = cls(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats, **extra)
        if module.affine:
            new.weight, new.bias = module.weight, module.bias
        if module.track_running_stats:
            new.running_mean, new.running_var = module.running_mean, module.running_var
            new.num_batches_tracked = module.num_batches_tracked
        new.train(module.training)
        if hasattr(module, "qconfig"):
            new.qconfig = module.qconfig
        return new
    for name, child in module.named_children():
        replaced = convert_batchnorm(child, cls, **extra)
        if replaced is not child:
            setattr(module, name, replaced)
    return module
