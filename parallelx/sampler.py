"""A distributed sampler that knows which of its samples are padding.

``torch.utils.data.DistributedSampler`` pads the index list so that every rank
gets the same number of samples (ranks that run out of batches early would
leave the others waiting in a collective).  The padding repeats samples, and
metrics computed over a padded shard count those samples twice.
:class:`ShardedSampler` pads the same way but records, for its rank, how many
leading positions are real (:attr:`num_real`), so that metrics can mask the
rest: see :func:`parallelx.metrics.real_mask`.

It also advances its epoch by itself: every new iteration uses the next
epoch's shuffle, so a forgotten ``set_epoch`` cannot repeat the same order.
``set_epoch`` still works and wins when called.

It remembers the order of its latest pass (:meth:`ShardedSampler.last_order`),
so that rows produced over that pass on every rank can be put back in dataset
order (:meth:`ShardedSampler.dataset_index`, used by
``Backend.gather_in_order``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import Sampler

from .errors import ParallelxError


class ShardedSampler(Sampler[int]):
    """Shard ``dataset`` over ``num_replicas`` ranks, padding to equal length.

    The global order is a permutation of ``range(len(dataset))`` (seeded by
    ``seed + epoch``, identical on every rank) or the identity when
    ``shuffle=False``; it is padded by repeating its head (or truncated when
    ``drop_last``) to a multiple of ``num_replicas``, and rank ``r`` takes
    positions ``r, r + W, r + 2W, ...``.  Position ``p`` of the padded list is
    padding exactly when ``p >= len(dataset)``, so the real samples of each rank
    come first and number :attr:`num_real`.
    """

    def __init__(
        self,
        dataset: Sized,
        *,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if num_replicas < 1:
            raise ParallelxError(f"num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ParallelxError(f"rank must be in [0, {num_replicas}), got {rank}")
        self.dataset_size = len(dataset)
        if self.dataset_size == 0:
            raise ParallelxError("cannot shard an empty dataset")
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        #: Number of passes begun (iterations started); never reset, unlike ``epoch``.
        self.passes = 0
        #: The epoch whose order the latest pass used (None before the first pass).
        self.last_epoch: int | None = None
        if drop_last:
            self.num_samples = self.dataset_size // num_replicas
            if self.num_samples == 0:
                raise ParallelxError(
                    f"drop_last=True with {self.dataset_size} samples and {num_replicas} ranks "
                    "leaves every rank empty; use drop_last=False or fewer ranks"
                )
        else:
            self.num_samples = math.ceil(self.dataset_size / num_replicas)
        self.total_size = self.num_samples * num_replicas
        # Real positions of this rank: p = rank + i * W < dataset_size.
        real = max(0, math.ceil((self.dataset_size - rank) / num_replicas))
        self.num_real = min(self.num_samples, real)

    def real_mask(self, start: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """True for the real samples among positions ``[start, start + count)`` of this shard."""
        return torch.arange(start, start + count, device=device) < self.num_real

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s shuffle for the next iteration (then count on from it)."""
        self.epoch = int(epoch)

    def global_order(self, epoch: int) -> list[int]:
        """The padded global index list for ``epoch`` (same on every rank)."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order = torch.randperm(self.dataset_size, generator=g).tolist()
        else:
            order = list(range(self.dataset_size))
        if self.total_size > len(order):
            pad = self.total_size - len(order)
            order += (order * math.ceil(pad / len(order)))[:pad]
        return order[: self.total_size]

    def last_order(self) -> list[int]:
        """The padded global index list of the latest pass (what :meth:`global_order`
        gave for the epoch that pass used)."""
        if self.last_epoch is None:
            raise ParallelxError("this sampler has not been iterated yet: the order of a pass is known once "
                                 "a loader built on it has started that pass")
        return self.global_order(self.last_epoch)

    def dataset_index(self) -> torch.Tensor:
        """Where each sample's row is among the rows of the latest pass gathered
        from all ranks in rank order (rank 0's whole shard, then rank 1's, ...):
        ``gathered[sampler.dataset_index()]`` has row ``i`` = sample ``i``, the
        padding duplicates left out."""
        if self.total_size < self.dataset_size:
            raise ParallelxError(f"drop_last=True leaves {self.dataset_size - self.total_size} of the "
                                 f"{self.dataset_size} samples out of every pass, so there is no row for them; "
                                 "build the sampler with drop_last=False to gather in dataset order")
        order = torch.tensor(self.last_order()[: self.dataset_size], dtype=torch.int64)
        # Position p of the padded order is row p // W of rank p % W's shard.
        position = torch.arange(self.dataset_size, dtype=torch.int64)
        rows = (position % self.num_replicas) * self.num_samples + position // self.num_replicas
        index = torch.empty(self.dataset_size, dtype=torch.int64)
        index[order] = rows  # positions below dataset_size hold every sample exactly once
        return index

    def __iter__(self) -> Iterator[int]:
        epoch = self.epoch
        self.last_epoch = epoch
        self.passes += 1
        self.epoch += 1  # the next iteration is the next epoch, set_epoch or not
        return iter(self.global_order(epoch)[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples
