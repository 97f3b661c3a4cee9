"""Module buffers (BatchNorm's running statistics) kept equal on every rank.

A forward in training mode updates buffers from the batch it sees: each rank
sees its own shard, so without a rule every rank ends a step with different
running statistics, and a distributed evaluation (each rank scoring its part
of the validation set) no longer equals a one-process evaluation of the
checkpoint rank 0 saves.

**The rule, the same on every backend:** after every optimizer step each
rank takes rank 0's buffers (one broadcast of their bytes).  Rank 0's,
because they are what rank 0 saves and what ``DistributedDataParallel``
keeps (``broadcast_buffers=True``), so the weights and buffers of the saved
checkpoint are those of every backend, and a resumed run, whose ranks all load
that checkpoint, stays in step.  Averaging would be no closer to one process
on the global batch (which needs ``backend.sync_batchnorm(model)``: global
statistics in every forward) and would change what DDP users already get.

The step is the place: every rank steps together (gradients are averaged
there), so the broadcast can never wait for a rank that is not coming, and
an evaluation between steps sees the buffers the checkpoint holds.  It runs
from an optimizer step hook, so a loop that calls ``optimizer.step()`` itself
is covered as well as ``backend.step``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from parallelx.log import warn
from parallelx.transforms.batchnorm import SyncBatchNorm

#: Set on a BatchNorm layer that :meth:`Backend.sync_batchnorm` converted
#: (whatever class the backend converted it to): its statistics are global.
GLOBAL_STATS_MARK = "_parallelx_global_statistics"

PER_PROCESS_WARNING = (
    "BatchNorm layers normalise with each process's own batch statistics in training; after every optimizer step "
    "every rank takes rank 0's running statistics (what rank 0 saves), so evaluation and checkpoints agree; "
    "model = backend.sync_batchnorm(model) before wrap_model normalises with the global batch's"
)

Broadcast = Callable[[torch.Tensor], torch.Tensor]


def mark_global_statistics(model: nn.Module) -> None:
    """Mark every BatchNorm layer of ``model`` as normalising with global statistics."""
    for m in model.modules():
        if isinstance(m, _BatchNorm):
            setattr(m, GLOBAL_STATS_MARK, True)


def per_process_batchnorm(model: nn.Module) -> bool:
    """True when a BatchNorm layer of ``model`` normalises with its process's own batch."""
    return any(
        isinstance(m, _BatchNorm)
        and not isinstance(m, (nn.SyncBatchNorm, SyncBatchNorm))
        and not getattr(m, GLOBAL_STATS_MARK, False)
        for m in model.modules()
    )


def warn_if_per_process(model: nn.Module, world_size: int) -> None:
    """The one BatchNorm warning of a job (printed once, by rank 0), on every backend alike."""
    if world_size > 1 and per_process_batchnorm(model):
        warn(PER_PROCESS_WARNING)


def sync_buffers(modules: Iterable[nn.Module], broadcast: Broadcast) -> None:
    """Give every rank rank 0's buffers of ``modules``, in place (a collective:
    every rank calls it).  The buffers travel as their bytes in one tensor per
    device: one broadcast whatever their dtypes (Horovod, for one, pays a
    cycle per collective)."""
    groups: dict[torch.device, list[torch.Tensor]] = {}
    seen: set[int] = set()
    for module in modules:
        for buf in module.buffers():
            if id(buf) not in seen and buf.numel() > 0:
                seen.add(id(buf))
                groups.setdefault(buf.device, []).append(buf)
    for _, bufs in sorted(groups.items(), key=lambda kv: str(kv[0])):
        raw = broadcast(torch.cat([b.detach().contiguous().reshape(-1).view(torch.uint8) for b in bufs]))
        offset = 0
        with torch.no_grad():
            for b in bufs:
                n = b.numel() * b.element_size()
                b.copy_(raw[offset : offset + n].view(b.dtype).view_as(b))
                offset += n


class BufferSync:
    """For each optimizer a backend wraps, broadcasts rank 0's buffers of the set-up models it
    trains after each step (the models are the run's one list of them)."""

    def __init__(self, broadcast: Broadcast, models: Callable[[], list[nn.Module]]) -> None:
        self._broadcast = broadcast
        self._models = models

    def attach(self, params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        """Hook ``optimizer`` (built on ``params``) to sync the buffers of the set-up models it trains."""
        wanted = {id(p) for p in params}
        owners = [
            weakref.ref(m)
            for m in self._models()
            if any(id(p) in wanted for p in m.parameters()) and any(True for _ in m.buffers())
        ]
        if not owners:
            return
        depth = [0]

        # A wrapper optimizer's step calls its base class's step, and torch runs
        # the hooks around both: count the nesting, sync once at the outermost.
        def pre(opt: Any, args: Any, kwargs: Any) -> None:
            depth[0] += 1

        def post(opt: Any, args: Any, kwargs: Any) -> None:
            depth[0] = max(0, depth[0] - 1)  # a wrapper that runs post hooks only still syncs
            if depth[0] == 0:
                sync_buffers([m for ref in owners if (m := ref()) is not None], self._broadcast)

        optimizer.register_step_pre_hook(pre)
        optimizer.register_step_post_hook(post)
