"""Exact global metrics over a sharded dataset.

Each rank sums its own per-sample statistics over the *real* samples of its
shard (padding duplicates masked out, see :class:`~parallelx.ShardedSampler`),
and one all-reduce of the sums gives the figure a single process would compute
over the whole dataset: every sample counted once, divided by the true size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .backend import Backend
    from .sampler import ShardedSampler


def real_mask(sampler: ShardedSampler, start: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean mask for positions ``[start, start + count)`` of this rank's shard:
    True for real samples, False for padding duplicates."""
    pos = torch.arange(start, start + count, device=device)
    return pos < sampler.num_real


class MetricSums:
    """Running sums of per-sample loss and correctness, reduced across ranks.

    Loss sums are kept in float64 and counts in int64, so the global figures
    do not depend on how the dataset was split (up to float64 rounding of the
    loss; accuracy is an exact integer ratio).
    """

    def __init__(self) -> None:
        self.loss_sum = torch.zeros((), dtype=torch.float64)
        self.correct = torch.zeros((), dtype=torch.int64)
        self.count = torch.zeros((), dtype=torch.int64)

    def update(self, per_sample_loss: torch.Tensor, correct: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Add one batch: ``per_sample_loss`` (float, shape [B]), ``correct`` (bool, [B])."""
        loss = per_sample_loss.detach().to("cpu", torch.float64)
        ok = correct.detach().to("cpu")
        if mask is not None:
            m = mask.to("cpu")
            loss, ok = loss[m], ok[m]
        self.loss_sum += loss.sum()
        self.correct += ok.sum()
        self.count += ok.numel()

    def compute(self, backend: Backend | None = None) -> dict[str, float]:
        """Global ``loss``, ``acc`` and ``count``; a collective when ``backend`` is given:
        every rank must call it."""
        loss_sum, correct, count = self.loss_sum, self.correct, self.count
        if backend is not None:
            loss_sum = backend.all_reduce(loss_sum, op="sum")
            packed = backend.all_reduce(torch.stack([correct, count]), op="sum")
            correct, count = packed[0], packed[1]
        n = int(count)
        return {
            "loss": float(loss_sum) / n if n else float("nan"),
            "acc": int(correct) / n if n else float("nan"),
            "count": n,
            "correct": int(correct),
        }
