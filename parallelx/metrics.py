"""Exact global metrics over a sharded dataset.

Each rank sums its own per-sample statistics over the *real* samples of its
shard (the sampler's padding duplicates left out), and one all-reduce of the
sums gives the figure a single process would compute over the whole dataset:
every sample counted once, divided by the true size.

Given the sampler, :class:`MetricSums` does the bookkeeping itself::

    sums = MetricSums(sampler)
    for x, y in loader:                       # loader built on that sampler
        out = model(x)
        sums.update(criterion(out, y), out.argmax(1) == y)
    print(sums.compute(backend))              # {'loss': ..., 'acc': ..., 'count': len(dataset)}

The sums stay on the device of the values given: no host synchronisation per
batch on GPUs, only at :meth:`MetricSums.compute`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .errors import ParallelxError

if TYPE_CHECKING:
    from .protocol import Backend
    from .sampler import ShardedSampler


def real_mask(sampler: ShardedSampler, start: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean mask for positions ``[start, start + count)`` of this rank's shard:
    True for real samples, False for padding duplicates."""
    return sampler.real_mask(start, count, device)


class MetricSums:
    """Running sums of per-sample loss and correctness, reduced across ranks.

    With ``sampler`` (the one the loader draws from), each :meth:`update`
    masks the padding by position in this rank's shard, and a new pass over
    the sampler starts counting positions afresh.  Without it, pass ``mask``
    to :meth:`update` yourself (or nothing, when there is no padding).

    Loss sums are kept in float64 and counts in int64, so the global figures
    do not depend on how the dataset was split (up to float64 rounding of the
    loss; accuracy is an exact integer ratio).
    """

    def __init__(self, sampler: ShardedSampler | None = None) -> None:
        self.sampler = sampler
        self.loss_sum = torch.zeros((), dtype=torch.float64)
        self.correct = torch.zeros((), dtype=torch.int64)
        self.count = torch.zeros((), dtype=torch.int64)
        self._position = 0
        self._pass = None if sampler is None else sampler.passes

    def update(self, per_sample_loss: torch.Tensor, correct: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Add one batch: ``per_sample_loss`` (float, shape [B]), ``correct`` (bool, [B])."""
        loss = per_sample_loss.detach().reshape(-1)
        ok = correct.detach().reshape(-1)
        if loss.shape != ok.shape:
            raise ParallelxError(f"MetricSums.update: {loss.numel()} losses but {ok.numel()} correctness values")
        device = loss.device
        if self.loss_sum.device != device:
            self.loss_sum, self.correct, self.count = (t.to(device) for t in (self.loss_sum, self.correct, self.count))
        if mask is None and self.sampler is not None:
            mask = self._next_mask(len(loss), device)
        loss = loss.to(torch.float64)
        ok = ok.to(torch.int64)
        if mask is None:
            self.loss_sum += loss.sum()
            self.correct += ok.sum()
            self.count += ok.numel()
        else:
            # Multiply rather than index: boolean indexing syncs with the host on GPUs.
            m = mask.to(device).reshape(-1)
            self.loss_sum += torch.where(m, loss, torch.zeros_like(loss)).sum()
            self.correct += (ok * m).sum()
            self.count += m.sum()

    def _next_mask(self, n: int, device: torch.device) -> torch.Tensor:
        sampler = self.sampler
        assert sampler is not None
        if sampler.passes != self._pass:  # a new pass over the sampler began
            self._pass, self._position = sampler.passes, 0
        if self._position + n > len(sampler):
            raise ParallelxError(
                f"MetricSums: {self._position + n} samples given in one pass, but this rank's "
                f"shard has {len(sampler)}; is the loader built on this sampler?"
            )
        mask = sampler.real_mask(self._position, n, device)
        self._position += n
        return mask

    def compute(self, backend: Backend | None = None) -> dict[str, float]:
        """Global ``loss``, ``acc``, ``count`` and ``correct``; a collective when
        ``backend`` is given: every rank must call it."""
        loss_sum = self.loss_sum
        packed = torch.stack([self.correct, self.count])
        if backend is not None:
            loss_sum = backend.all_reduce(loss_sum, op="sum")
            packed = backend.all_reduce(packed, op="sum")
        correct, n = int(packed[0]), int(packed[1])
        return {
            "loss": float(loss_sum) / n if n else float("nan"),
            "acc": correct / n if n else float("nan"),
            "count": n,
            "correct": correct,
        }
