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

Without correctness (a language model's loss, a regression), pass ``None``
and :meth:`MetricSums.compute` gives the loss and the count only::

    sums.update(per_sequence_loss, None)

The sums stay on the device of the values given: no host synchronisation per
batch on GPUs, only at :meth:`MetricSums.compute`.  :meth:`MetricSums.state_dict`
and :meth:`MetricSums.load_state_dict` carry the sums of a pass cut short by a
checkpoint into the resumed run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from parallelx.errors import ParallelxError
from parallelx.parts.gather import all_gather_object
from parallelx.utils import plain_tensor

if TYPE_CHECKING:
    from parallelx.backend import Backend
    from parallelx.parts.collectives import Collectives
    from parallelx.parts.sampler import ShardedSampler


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
        #: Whether correctness was given (None before the first update): every update must agree.
        self.tracks_correct: bool | None = None
        self._position = 0
        self._pass = None if sampler is None else sampler.passes

    def update(
        self, per_sample_loss: torch.Tensor, correct: torch.Tensor | None, mask: torch.Tensor | None = None
    ) -> None:
        """Add one batch: ``per_sample_loss`` (float, shape [B]) and ``correct``
        (bool, [B]), or ``None`` for a loss-only metric."""
        loss = plain_tensor(per_sample_loss.detach()).reshape(-1)  # --loss-parallel's losses are DTensors
        tracks = correct is not None
        if self.tracks_correct is not None and tracks != self.tracks_correct:
            raise ParallelxError(
                "MetricSums.update: correct was "
                + ("None before and is a tensor now" if tracks else "given before and is None now")
                + "; pass correctness for every batch, or None for every batch (a loss-only metric)"
            )
        ok = (
            plain_tensor(correct.detach()).reshape(-1)
            if correct is not None
            else torch.zeros_like(loss, dtype=torch.int64)
        )
        if loss.shape != ok.shape:
            raise ParallelxError(f"MetricSums.update: {loss.numel()} losses but {ok.numel()} correctness values")
        self.tracks_correct = tracks
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
        """Global ``loss`` and ``count``, and ``acc`` and ``correct`` unless the
        metric is loss-only; a collective when ``backend`` is given: every rank
        must call it (a rank that saw no batch too)."""
        loss_sum = self.loss_sum
        # Whether a rank is loss-only travels with the counts: a rank that saw no batch cannot know.
        loss_only = torch.tensor(int(self.tracks_correct is False)).to(self.count)
        packed = torch.stack([self.correct, self.count, loss_only])
        if backend is not None:  # over the data-parallel ranks: a tensor-parallel group's sums once
            comm = _data_comm(backend)
            loss_sum = comm.all_reduce(loss_sum, op="sum")
            packed = comm.all_reduce(packed, op="sum")
        correct, n = int(packed[0]), int(packed[1])
        result: dict[str, float] = {"loss": float(loss_sum) / n if n else float("nan"), "count": n}
        if int(packed[2]) == 0:
            result.update(acc=correct / n if n else float("nan"), correct=correct)
        return result

    # ------------------------------------------------------------ resuming
    def state_dict(self, backend: Backend | None = None) -> dict[str, Any]:
        """The sums so far as plain numbers, to store in a checkpoint: every
        rank's when ``backend`` is given (a collective: every rank must call it)."""
        mine = {
            "loss_sum": float(self.loss_sum),  # a float64 tensor: exact as a Python float
            "correct": int(self.correct),
            "count": int(self.count),
            "tracks_correct": self.tracks_correct,
        }
        return {"ranks": [mine] if backend is None else all_gather_object(_data_comm(backend), mine)}

    def load_state_dict(self, state: dict[str, Any], backend: Backend | None = None) -> None:
        """Continue from :meth:`state_dict`'s sums.  At the world size that
        saved them each rank takes its own, so the totals round as they would
        have; at another, rank 0 takes the totals and the others start at 0."""
        try:
            ranks = [
                (float(r["loss_sum"]), int(r["correct"]), int(r["count"]), r["tracks_correct"]) for r in state["ranks"]
            ]
        except (KeyError, TypeError, ValueError) as exc:
            raise ParallelxError(f"not a MetricSums state ({type(exc).__name__}: {exc})") from None
        rank, world = (0, 1) if backend is None else (backend.mesh.data_rank, backend.mesh.data_size)
        if len(ranks) == world:
            loss_sum, correct, count, tracks = ranks[rank]
        elif rank == 0:
            loss_sum, correct, count = sum(r[0] for r in ranks), sum(r[1] for r in ranks), sum(r[2] for r in ranks)
            tracks = next((r[3] for r in ranks if r[3] is not None), None)
        else:
            loss_sum, correct, count, tracks = 0.0, 0, 0, None
        device = self.loss_sum.device
        self.loss_sum = torch.tensor(loss_sum, dtype=torch.float64, device=device)
        self.correct = torch.tensor(correct, dtype=torch.int64, device=device)
        self.count = torch.tensor(count, dtype=torch.int64, device=device)
        self.tracks_correct = tracks


def _data_comm(backend: Backend) -> Collectives:
    """The collectives over the ranks that read different data (the world without tensor parallelism)."""
    if not backend.initialized:
        raise ParallelxError(f"backend {backend.name!r} is not initialised: call backend.init() first")
    return backend.mesh.data_comm or backend.comm
