"""The one-process reference of ``python -m parallelx check``: one process
computing, step by step, what N ranks compute together.

The user's script runs once, on the ``single`` backend, and sees rank 0 of a
world of N (``backend.world_size == N``).  Inside:

- every sampler from ``backend.make_sampler`` is a :class:`VirtualSampler`:
  to the script, rank 0's shard (its length, its padding); to a
  ``DataLoader``, the N ranks' batches in turn: rank 0's first batch, rank
  1's first batch, ..., then each rank's second batch, each rank's own shard
  cut into batches exactly as a DataLoader on that rank cuts it;
- before each virtual rank's batch is read, the random generators and the
  models' buffers are put where that rank would have them: each rank of a
  run started from the same seed draws the same numbers, so every rank's
  batch of a round starts from the state the round started with (dropout
  masks, augmentation); each rank updates its own buffers (BatchNorm's
  running statistics) during a step, and after the step every rank has rank
  0's, as parallelx's buffer rule gives them;
- in the loop form (``backend.batches`` / ``backend.step``) each window holds
  the N ranks' micro-batches of one window: the loss is divided by N times the
  window's length, which is the average over the ranks;
- in the protocol form (``backend.backward`` or ``loss.backward()``, then a
  plain ``optimizer.step()``) the optimizer steps once every N calls, on the
  average of the N gradients; ``zero_grad()``, gradient clipping and
  ``scheduler.step()`` between them are held back until the step.

What it cannot reproduce it reports (:meth:`VirtualWorld.report`), and the
check then compares the backends with each other only: data read without
``backend.make_sampler``, a sampler iterated outside a DataLoader.
"""

from __future__ import annotations

import dataclasses
import random
import types
import weakref
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader

from parallelx.parts.loop import LoopOptions
from parallelx.parts.sampler import ShardedSampler

T = TypeVar("T")

#: (the loop manages the current micro-batch, its position in the window, it is the window's last,
#: the loop is stepping).
Window = Callable[[], tuple[bool, int, bool, bool]]


class VirtualSampler(ShardedSampler):
    """Rank 0's :class:`ShardedSampler` of a world of ``ranks``, which a
    DataLoader iterates as all the ranks' batches in turn (see the module's docstring)."""

    def __init__(self, dataset: Sized, like: ShardedSampler, world: VirtualWorld) -> None:
        super().__init__(
            dataset,
            num_replicas=like.num_replicas,
            rank=0,
            shuffle=like.shuffle,
            seed=like.seed,
            drop_last=like.drop_last,
        )
        self.world = world
        self.shards = [
            ShardedSampler(
                dataset,
                num_replicas=like.num_replicas,
                rank=r,
                shuffle=like.shuffle,
                seed=like.seed,
                drop_last=like.drop_last,
            )
            for r in range(like.num_replicas)
        ]
        self.current = (0, 0)  # (virtual rank, position in its shard) of the batch being read
        self.batching: tuple[int, bool] | None = None
        self.last_schedule: list[tuple[int, int, list[int]]] = []

    def _orders(self) -> list[list[int]]:
        """Begin a pass on every rank's shard (the same epoch as rank 0's) and return their orders."""
        for s in self.shards:
            s.set_epoch(self.epoch)
        mine = list(ShardedSampler.__iter__(self))  # rank 0's bookkeeping (epoch, passes) as usual
        orders = [list(iter(s)) for s in self.shards]
        orders[0] = mine
        return orders

    def plan(self, batch_size: int, drop_last: bool) -> None:
        """The next pass is cut into batches of ``batch_size`` (a DataLoader's)."""
        self.batching = (batch_size, drop_last)

    def _begin(self) -> list[tuple[int, int, list[int]]]:
        """Start a pass: (rank, position in its shard, batch) for every rank's batches, round by round."""
        size, drop_last = self.batching or (1, False)
        self.batching = None
        orders = self._orders()
        per_rank = [
            [o[i : i + size] for i in range(0, len(o), size) if not drop_last or i + size <= len(o)] for o in orders
        ]
        rounds = min(len(b) for b in per_rank)
        self.last_schedule = [(r, j * size, per_rank[r][j]) for j in range(rounds) for r in range(len(per_rank))]
        return self.last_schedule

    def tick(self, rank: int, position: int) -> None:
        """Rank ``rank``'s batch at ``position`` of its shard is about to be read."""
        self.current = (rank, position)
        # MetricSums counts positions per pass: each batch starts one (real_mask below knows where it is).
        self.passes += 1
        self.world.micro_batch(rank)

    def batches(self, batch_size: int, drop_last: bool) -> Iterator[list[int]]:
        """What a DataLoader with ``batch_size`` draws: each rank's batches, round by round."""
        self.plan(batch_size, drop_last)
        for rank, position, batch in self._begin():
            self.tick(rank, position)
            yield batch

    def __iter__(self) -> Iterator[int]:
        # Begun at once, as ShardedSampler's (a wrapper may read last_epoch right after iter()).
        planned = self.batching is not None
        schedule = self._begin()
        if planned:  # a wrapper sampler's DataLoader batches this stream and ticks (install)
            return (i for _, _, batch in schedule for i in batch)
        return self._one_by_one(schedule)

    def _one_by_one(self, schedule: list[tuple[int, int, list[int]]]) -> Iterator[int]:
        for rank, position, batch in schedule:
            self.tick(rank, position)
            yield batch[0]

    def real_mask(self, start: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
        rank, position = self.current
        return self.shards[rank].real_mask(position + start, count, device)


def virtual_inside(sampler: Any, depth: int = 4) -> VirtualSampler | None:
    """The virtual sampler ``sampler`` is, or wraps (through ``.sampler`` attributes)."""
    for _ in range(depth):
        if isinstance(sampler, VirtualSampler):
            return sampler
        sampler = getattr(sampler, "sampler", None)
        if sampler is None:
            return None
    return None


def _wrapped_batches(wrapper: Any, virtual: VirtualSampler, batch_size: int, drop_last: bool) -> Iterator[list[Any]]:
    """A wrapper sampler's items (one per index of ``virtual``), cut into each rank's batches."""
    virtual.plan(batch_size, drop_last)
    stream = iter(wrapper)
    schedule = virtual.last_schedule
    for rank, position, batch in schedule:
        virtual.tick(rank, position)
        yield [next(stream) for _ in batch]


class StepsOfN:
    """A plain ``optimizer.step()`` that applies once every ``ranks`` calls,
    on the average of the gradients gathered meanwhile (the protocol form)."""

    def __init__(self, optimizer: torch.optim.Optimizer, ranks: int, window: Window) -> None:
        self.optimizer = optimizer
        self.ranks = ranks
        self.window = window
        self.pending = 0  # calls held back since the last real step
        self.averaged = False  # the gradients were divided by ranks already (clipping came first)
        cls = type(optimizer)
        self.real_step = cls.step
        self.real_zero_grad = cls.zero_grad
        self.params = {id(p) for group in optimizer.param_groups for p in group["params"]}

    def owns(self, params: Iterable[torch.Tensor]) -> bool:
        return any(id(p) in self.params for p in params)

    def install(self) -> None:
        self.optimizer.step = types.MethodType(_held_step, self.optimizer)  # type: ignore[method-assign]
        self.optimizer.zero_grad = types.MethodType(_held_zero_grad, self.optimizer)  # type: ignore[method-assign]

    def looped(self) -> bool:
        return self.window()[3]

    def holding(self) -> bool:
        """True while the calls of a round are being held back."""
        return self.pending > 0 and not self.looped()

    def next_is_real(self) -> bool:
        return self.pending >= self.ranks - 1

    def average(self) -> None:
        if not self.averaged:
            with torch.no_grad():
                for group in self.optimizer.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.grad.div_(self.ranks)
            self.averaged = True

    def may_clip(self) -> bool:
        """Clipping by the script itself acts on the whole average only: at the
        window's last micro-batch (the loop form), or before the real step."""
        managed, _, boundary, stepping = self.window()
        if stepping or managed:
            return stepping or boundary
        if self.next_is_real():
            self.average()
            return True
        return False

    def may_zero(self) -> bool:
        managed, position, _, stepping = self.window()
        if stepping:
            return True
        if managed:  # the loop form: the window's first micro-batch only
            return position == 0
        return self.pending == 0


_HELD: weakref.WeakKeyDictionary[Any, StepsOfN] = weakref.WeakKeyDictionary()


def _held_step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
    held = _HELD[optimizer]
    if held.looped():
        return held.real_step(optimizer, *args, **kwargs)
    held.pending += 1
    if held.pending < held.ranks:
        return None
    held.average()
    held.pending, held.averaged = 0, False
    return held.real_step(optimizer, *args, **kwargs)


def _held_zero_grad(optimizer: Any, set_to_none: bool = True) -> None:
    held = _HELD[optimizer]
    if held.may_zero():
        held.real_zero_grad(optimizer, set_to_none)


class VirtualWorld:
    """The reference's world of ``ranks`` ranks in this one process."""

    def __init__(self, ranks: int, models: Callable[[], list[nn.Module]], window: Window) -> None:
        self.ranks = ranks
        self.models = models
        self.window = window
        #: The virtual rank whose batch is being read and computed (None before the first).
        self.current_rank: int | None = None
        self.round_rng: tuple[Any, ...] | None = None
        self.step_buffers: list[torch.Tensor] | None = None  # the buffers every rank starts the step with
        self.rank_buffers: dict[int, list[torch.Tensor]] = {}
        self.samplers: list[VirtualSampler] = []
        self.held: list[StepsOfN] = []
        self.unsharded_loaders = 0
        self.batches_read = 0

    # -------------------------------------------------------------- the script's objects
    def sampler(self, sampler: ShardedSampler, dataset: Sized) -> VirtualSampler:
        virtual = VirtualSampler(dataset, sampler, self)
        self.samplers.append(virtual)
        return virtual

    def take_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        held = StepsOfN(optimizer, self.ranks, self.window)
        _HELD[optimizer] = held
        held.install()
        self.held.append(held)

    def loader_view(self, loader: Iterable[T]) -> tuple[Iterable[T], int]:
        """The loop form: ``loader`` as the loop should see it (its length times
        the ranks when it is built on a virtual sampler), and that factor."""
        if isinstance(loader, DataLoader) and virtual_inside(_sampler_of(loader)) is not None:
            return _Longer(loader, self.ranks), self.ranks
        self.unsharded_loaders += 1
        return loader, 1

    def window_options(self, options: LoopOptions, factor: int) -> LoopOptions:
        return dataclasses.replace(options, accumulate=options.accumulate * factor) if factor > 1 else options

    # -------------------------------------------------------------- the clock
    def micro_batch(self, rank: int) -> None:
        """Virtual rank ``rank``'s next batch is about to be read."""
        self.batches_read += 1
        if rank == 0 or self.round_rng is None:
            self.round_rng = _rng_state()
        else:
            _set_rng_state(self.round_rng)
        buffers = self._buffers()
        if buffers:
            if self.step_buffers is None:
                self.step_buffers = [b.detach().clone() for b in buffers]
            if self.current_rank is not None and self.current_rank != rank:
                self.rank_buffers[self.current_rank] = [b.detach().clone() for b in buffers]
                _load(buffers, self.rank_buffers.get(rank, self.step_buffers))
        self.current_rank = rank

    def step_done(self) -> None:
        """After each real step every rank holds rank 0's buffers."""
        buffers = self._buffers()
        if buffers and self.current_rank not in (None, 0) and 0 in self.rank_buffers:
            _load(buffers, self.rank_buffers[0])
        self.step_buffers = None
        self.rank_buffers = {}
        self.current_rank = None if self.current_rank is None else 0

    def _buffers(self) -> list[torch.Tensor]:
        seen: set[int] = set()
        out = []
        for model in self.models():
            for b in model.buffers():
                if id(b) not in seen:
                    seen.add(id(b))
                    out.append(b)
        return out

    # -------------------------------------------------------------- what it could do
    def report(self) -> dict[str, Any]:
        """Whether the global batch was reproduced, and if not, why."""
        limits = []
        if not self.samplers:
            limits.append(
                "the script reads no data through backend.make_sampler (it draws or splits its batches "
                "itself), so one process cannot know what each rank read"
            )
        elif self.batches_read == 0:
            limits.append("no DataLoader drew from the samplers of backend.make_sampler (a sampler not passed to it?)")
        if self.unsharded_loaders:
            limits.append("a loader given to backend.batches is not built on a sampler of backend.make_sampler")
        return {"ranks": self.ranks, "limits": limits, "batches_read": self.batches_read}


# ---------------------------------------------------------------- process-wide patches
#: (owner, attribute, original) of every patch in place.
_PATCHED: list[tuple[Any, str, Any]] = []


def install() -> None:
    """Patch, in this process only (the reference runs nothing else): a
    DataLoader on a virtual sampler draws its rounds, in the main process;
    gradient clipping, ``zero_grad`` and LR schedulers wait for a held-back
    step.  Each patch calls the original for everything else."""
    if _PATCHED:
        return
    batch_iter, scheduler_step = BatchSampler.__iter__, torch.optim.lr_scheduler.LRScheduler.step
    clip, module_zero_grad, loader_iter = torch.nn.utils.clip_grad_norm_, nn.Module.zero_grad, DataLoader.__iter__

    def rounds_iter(self: BatchSampler) -> Iterator[list[Any]]:
        virtual = virtual_inside(self.sampler)
        if virtual is None:
            return batch_iter(self)
        if virtual is self.sampler:
            return virtual.batches(self.batch_size, self.drop_last)
        return _wrapped_batches(self.sampler, virtual, self.batch_size, self.drop_last)

    def held_scheduler_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        held = _HELD.get(self.optimizer)
        if held is not None and held.holding():
            return None
        return scheduler_step(self, *args, **kwargs)

    def held_clip(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if all(held.may_clip() for held in list(_HELD.values()) if held.owns(params)):
            return clip(params, max_norm, *args, **kwargs)
        # Part of a round: the average is clipped when it is whole.
        grads = [p.grad for p in params if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())

    def held_module_zero_grad(self: nn.Module, set_to_none: bool = True) -> None:
        params = list(self.parameters())
        if all(held.may_zero() for held in list(_HELD.values()) if held.owns(params)):
            module_zero_grad(self, set_to_none)

    def main_process_iter(self: DataLoader) -> Any:
        # Workers read ahead of the training: each rank's random numbers could not be
        # replayed at the right moments.  The reference reads in its main process.
        if self.num_workers > 0 and virtual_inside(_sampler_of(self)) is not None:
            self.num_workers = 0
        return loader_iter(self)

    for owner, name, new in (
        (BatchSampler, "__iter__", rounds_iter),
        (torch.optim.lr_scheduler.LRScheduler, "step", held_scheduler_step),
        (torch.nn.utils, "clip_grad_norm_", held_clip),
        (torch.nn.utils.clip_grad, "clip_grad_norm_", held_clip),
        (nn.Module, "zero_grad", held_module_zero_grad),
        (DataLoader, "__iter__", main_process_iter),
    ):
        _PATCHED.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)


def uninstall() -> None:
    """Undo :func:`install` (for tests that build a virtual world in their own process)."""
    while _PATCHED:
        owner, name, original = _PATCHED.pop()
        setattr(owner, name, original)


class _Longer:
    """A loader whose ``len`` counts every virtual rank's batches."""

    def __init__(self, loader: DataLoader, ranks: int) -> None:
        self.loader = loader
        self.ranks = ranks

    def __len__(self) -> int:
        return len(self.loader) * self.ranks

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)


def _sampler_of(loader: DataLoader) -> Any:
    batch_sampler = getattr(loader, "batch_sampler", None)
    inner = getattr(batch_sampler, "sampler", None)
    return inner if inner is not None else getattr(loader, "sampler", None)


def _rng_state() -> tuple[Any, ...]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[Any, ...]) -> None:
    py, np_state, cpu, cuda = state
    random.setstate(py)
    np.random.set_state(np_state)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _load(buffers: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for b, v in zip(buffers, values):
            b.copy_(v)
