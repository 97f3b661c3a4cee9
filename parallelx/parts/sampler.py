"""A distributed sampler that knows which of its samples are padding.

``torch.utils.data.DistributedSampler`` pads the index list so that every rank
gets the same number of samples (ranks that run out of batches early would
leave the others waiting in a collective).  The padding repeats samples, and
metrics computed over a padded shard count those samples twice.
:class:`ShardedSampler` pads the same way but records, for its rank, how many
leading positions are real (:attr:`num_real`), so that metrics can mask the
rest: see :func:`parallelx.training.metrics.real_mask`.

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

from parallelx.errors import ParallelxError
from parallelx.log import warn


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
        self._last_start = 0  # where in its epoch's order the latest pass began (a resumed pass: > 0)
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
        # Resuming (state_dict / load_state_dict): where the current pass began
        # in its epoch's global order, how many indices it has given out, and
        # the (epoch, position) a loaded state asks the next pass to start at.
        self._start = 0
        self._drawn = 0
        self._pass_epoch: int | None = None
        self._resume: tuple[int, int] | None = None

    def real_mask(self, start: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """True for the real samples among positions ``[start, start + count)`` of this shard."""
        return torch.arange(start, start + count, device=device) < self.num_real

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s shuffle for the next iteration (then count on from it)."""
        self.epoch = int(epoch)

    def _epoch_order(self, epoch: int) -> list[int]:
        """``epoch``'s order of the dataset's indices, unpadded (same on every rank)."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            return torch.randperm(self.dataset_size, generator=g).tolist()
        return list(range(self.dataset_size))

    def global_order(self, epoch: int) -> list[int]:
        """The padded global index list for ``epoch`` (same on every rank)."""
        order = self._epoch_order(epoch)
        if self.total_size > len(order):
            pad = self.total_size - len(order)
            order += (order * math.ceil(pad / len(order)))[:pad]
        return order[: self.total_size]

    def last_order(self) -> list[int]:
        """The padded global index list of the latest pass (what :meth:`global_order`
        gave for the epoch that pass used)."""
        if self.last_epoch is None:
            raise ParallelxError(
                "this sampler has not been iterated yet: the order of a pass is known once "
                "a loader built on it has started that pass"
            )
        if self._last_start:
            return self._rest_order(self.last_epoch, self._last_start)
        return self.global_order(self.last_epoch)

    def dataset_index(self) -> torch.Tensor:
        """Where each sample's row is among the rows of the latest pass gathered
        from all ranks in rank order (rank 0's whole shard, then rank 1's, ...):
        ``gathered[sampler.dataset_index()]`` has row ``i`` = sample ``i``, the
        padding duplicates left out."""
        if self._last_start or self._resume is not None:
            raise ParallelxError(
                "the latest pass resumed part of an epoch (load_state_dict), so it has no row for "
                "the samples done before; gather in dataset order over a whole pass"
            )
        if self.total_size < self.dataset_size:
            raise ParallelxError(
                f"drop_last=True leaves {self.dataset_size - self.total_size} of the "
                f"{self.dataset_size} samples out of every pass, so there is no row for them; "
                "build the sampler with drop_last=False to gather in dataset order"
            )
        order = torch.tensor(self.last_order()[: self.dataset_size], dtype=torch.int64)
        # Position p of the padded order is row p // W of rank p % W's shard.
        position = torch.arange(self.dataset_size, dtype=torch.int64)
        rows = (position % self.num_replicas) * self.num_samples + position // self.num_replicas
        index = torch.empty(self.dataset_size, dtype=torch.int64)
        index[order] = rows  # positions below dataset_size hold every sample exactly once
        return index

    def __iter__(self) -> Iterator[int]:
        epoch = self.epoch
        start = self._begin_pass(epoch)
        self.last_epoch, self._last_start = epoch, start
        self.passes += 1
        self.epoch += 1  # the next iteration is the next epoch, set_epoch or not
        order = self._rest_order(epoch, start) if start else self.global_order(epoch)
        return self._counted(order[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        if self._start and self._pass_epoch is not None and self._drawn >= self.num_samples:
            # A resumed (shorter) pass has given out all it had: what is asked
            # now is the next pass's length (a loader's len() before iterating),
            # and that pass is whole.
            w = self.num_replicas
            return self.dataset_size // w if self.drop_last else math.ceil(self.dataset_size / w)
        return self.num_samples

    # ----------------------------------------------------------- resuming
    def state_dict(self, consumed: int | None = None) -> dict[str, int | bool]:
        """Where this sampler stands, independent of the world size: the seed,
        the epoch and how many positions of that epoch's global order are done.

        ``consumed`` is the number of this rank's samples of the current pass
        that training has used (e.g. ``batches_done * batch_size``); without
        it, the number of indices the pass has handed out, which is the same
        when the loader draws them as it builds each batch (``num_workers=0``)
        but runs ahead of training with worker processes.  A finished pass
        counts as the start of the next epoch."""
        if self._resume is not None:  # loaded, not iterated yet: unchanged
            epoch, position = self._resume
        elif self._pass_epoch is None:
            epoch, position = self.epoch, 0
        else:
            done = self._drawn if consumed is None else int(consumed)
            if not 0 <= done <= self.num_samples:
                raise ParallelxError(
                    f"consumed must be in [0, {self.num_samples}] (this rank's samples in the "
                    f"current pass), got {consumed}"
                )
            epoch = self._pass_epoch
            position = self._start + min(done * self.num_replicas, self.dataset_size - self._start)
            if done == self.num_samples or position >= self.dataset_size:
                epoch, position = epoch + 1, 0
        return {
            "seed": self.seed,
            "epoch": epoch,
            "consumed": position,
            "dataset_size": self.dataset_size,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, int | bool]) -> None:
        """Continue from :meth:`state_dict`'s position, at any world size: the
        next pass gives only the samples of that epoch's global order not yet
        done, sharded over this sampler's ranks (padded at the end as usual,
        :attr:`num_real` and ``len()`` are this shorter pass's); the passes
        after it are whole epochs again."""
        try:
            seed, epoch, position = int(state["seed"]), int(state["epoch"]), int(state["consumed"])
            size, shuffle = int(state["dataset_size"]), bool(state["shuffle"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ParallelxError(f"not a sampler state ({type(exc).__name__}: {exc})") from None
        if size != self.dataset_size or shuffle != self.shuffle:
            raise ParallelxError(
                f"the sampler state is of a dataset of {size} samples (shuffle={shuffle}), this "
                f"sampler's has {self.dataset_size} (shuffle={self.shuffle}); resume with the "
                "same dataset"
            )
        if not 0 <= position <= size or epoch < 0:
            raise ParallelxError(f"the sampler state's position {position} (epoch {epoch}) is outside [0, {size}]")
        if position == size:
            epoch, position = epoch + 1, 0
        self.seed, self.epoch = seed, epoch
        self._resume = (epoch, position) if position else None
        self._pass_epoch, self._drawn = None, 0
        self._shape_pass(position)

    def _begin_pass(self, epoch: int) -> int:
        """Start a pass over ``epoch``: the position it starts at (a loaded
        state's, for the epoch it was saved in) with the geometry set for it."""
        start, pending, self._resume = 0, self._resume, None
        if pending is not None:
            if pending[0] == epoch:
                start = pending[1]
            else:
                warn(
                    f"sampler: the loaded state continues epoch {pending[0]} at position {pending[1]}, but this "
                    f"pass is epoch {epoch} (set_epoch changed it): epoch {epoch} is taken whole"
                )
        if start != self._start:
            self._shape_pass(start)
        self._drawn, self._pass_epoch = 0, epoch
        return start

    def _shape_pass(self, start: int) -> None:
        """``num_samples``, ``total_size`` and ``num_real`` of a pass over the
        ``dataset_size - start`` samples from position ``start`` on."""
        rest, w = self.dataset_size - start, self.num_replicas
        self.num_samples = rest // w if self.drop_last else math.ceil(rest / w)
        self.total_size = self.num_samples * w
        self.num_real = min(self.num_samples, max(0, math.ceil((rest - self.rank) / w)))
        self._start = start

    def _rest_order(self, epoch: int, start: int) -> list[int]:
        """Positions ``start`` to ``start + total_size`` of ``epoch``'s global
        order, padded past its end by repeating its head as :meth:`global_order`
        does: at an unchanged world size, exactly what the interrupted pass
        would have given from there on, padding included."""
        order = self._epoch_order(epoch)
        return [order[p % self.dataset_size] for p in range(start, start + self.total_size)]

    def _counted(self, indices: list[int]) -> Iterator[int]:
        for i in indices:
            self._drawn += 1
            yield i
