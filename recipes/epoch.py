"""One pass over a loader, training or evaluating, on any parallelx backend,
and the loaders the passes draw from.

- global loss and accuracy count every sample exactly once (the sampler's
  padding duplicates are masked out, sums are all-reduced), so they equal what
  one process computes with the same weights (:func:`evaluate_state_dict`);
- the shuffle changes every epoch (the sampler advances itself);
- a progress bar on the main rank only;
- data-loader workers sized per process, not ``cpu_count()`` in every process;
- a pass that a checkpoint interrupted continues from its :class:`EpochProgress`.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from parallelx import Backend, MetricSums, ShardedSampler, warn
from parallelx.errors import ParallelxError
from parallelx.utils import threads_per_process

from .config import FitConfig
from .data import EpochKeys, SeededSamples


def default_num_workers(local_world_size: int) -> int:
    """Loader workers per process: this process's share of the cores, less
    the one that trains, at most 8.  0 (load in the training process) when a
    process has a single core: more workers would only fight over it."""
    return min(8, threads_per_process(local_world_size) - 1)


def _loader(backend: Backend, dataset: Dataset, cfg: FitConfig, *, train: bool, keyed: bool = False) -> DataLoader:
    """The loader of one split.  ``keyed``: batches are ``(x, y, index)`` and
    each sample's augmentation depends on (seed, epoch, index) only
    (:class:`~recipes.data.SeededSamples`), which an exact resume needs."""
    workers = default_num_workers(backend.local_world_size) if cfg.num_workers is None else cfg.num_workers
    share = threads_per_process(backend.local_world_size)
    if workers > share:
        warn(
            f"--num-workers {workers} is more than this process's share of the CPU cores ({share}); "
            "the extra workers only compete for them"
        )
    sampler = backend.make_sampler(dataset, shuffle=train, seed=cfg.seed)
    return DataLoader(
        SeededSamples(dataset, cfg.seed) if keyed else dataset,
        batch_size=cfg.batch_size,
        sampler=EpochKeys(sampler) if keyed else sampler,
        num_workers=workers,
        pin_memory=backend.device.type == "cuda",
        persistent_workers=workers > 0,
        worker_init_fn=_own_process_group,
        # Random augmentations must differ between ranks; the shuffle must not.
        generator=torch.Generator().manual_seed(cfg.seed + 1000 * backend.rank),
    )


@dataclass
class EpochProgress:
    """How far the training pass of one epoch has got: what a checkpoint
    stores to continue it exactly.  ``loss_sum``, ``correct`` and ``count``
    are this rank's own metric sums; the other fields are equal on every rank."""

    batches: int = 0  # micro-batches of this epoch done, over all passes
    optimizer_steps: int = 0
    skipped: int = 0
    norm_sum: float = 0.0  # sum of the steps' gradient norms (a float32 value)
    loss_sum: float = 0.0
    correct: int = 0
    count: int = 0
    seconds: float = 0.0
    pass_start: int = field(default=0, compare=False)  # micro-batches done when this loader pass began


#: Called after every optimizer step with a snapshot function and whether the
#: pass ends with this step; True stops the pass (preemption).
StepHook = Callable[[Callable[[], EpochProgress], bool], bool]


def _sharded(loader: DataLoader) -> ShardedSampler:
    sampler = loader.sampler
    return sampler.sampler if isinstance(sampler, EpochKeys) else sampler  # type: ignore[return-value]


def _own_process_group(worker_id: int) -> None:
    """Loader workers leave their training process's process group: torchrun
    sends SIGTERM to that whole group, and a loader worker that dies of it
    takes its training process down before that process can save its
    checkpoint (see ``parallelx.Preemption``).  Workers still end with the
    loader (which may SIGTERM them itself), or within seconds of their
    training process."""
    os.setpgid(0, 0)


def run_epoch(
    backend: Backend,
    model: nn.Module,
    loader: DataLoader,
    criterion: Callable[..., torch.Tensor],
    *,
    optimizer: Any = None,
    scheduler: Any = None,
    desc: str = "",
    max_steps: int | None = None,
    progress: EpochProgress | None = None,
    on_step: StepHook | None = None,
    epoch: int = 0,
) -> dict[str, Any]:
    """One pass over ``loader``: trains when ``optimizer`` is given, else
    evaluates.  Returns the global ``loss``, ``acc``, ``count`` and
    ``seconds``; training adds ``lr`` (after the pass), ``grad_norm`` (mean
    over the optimizer steps, before clipping), ``steps`` and ``skipped``.
    ``criterion`` must return per-sample losses (``reduction="none"``).

    ``progress`` continues an epoch a checkpoint interrupted (its counts and
    this rank's metric sums; the loader's sampler already starts where it
    stopped); ``max_steps`` counts the micro-batches done before.
    ``on_step`` runs after every optimizer step; when it returns True the
    pass stops there and the result is ``{"stopped": True}``."""
    train = optimizer is not None
    model.train(train)
    sampler = _sharded(loader)
    sums = MetricSums(sampler)  # leaves the sampler's padding duplicates out by itself
    p = progress or EpochProgress()
    done = p.batches
    steps = len(loader) if max_steps is None else min(len(loader), max(1, max_steps - done))
    if train and p != EpochProgress():
        sums.loss_sum = torch.tensor(p.loss_sum, dtype=torch.float64)
        sums.correct = torch.tensor(p.correct, dtype=torch.int64)
        sums.count = torch.tensor(p.count, dtype=torch.int64)
    start = time.perf_counter()
    shows_bar = backend.is_main()
    # Training goes through backend.batches: accumulation windows, the same
    # number of batches on every rank; evaluation needs neither.
    batches = backend.batches(loader, limit=steps) if train else itertools.islice(loader, steps)
    bar = tqdm(batches, total=steps, desc=desc, disable=not shows_bar, leave=False, dynamic_ncols=True, mininterval=1.0)
    norm_sum = torch.tensor(p.norm_sum, dtype=torch.float32, device=backend.device)
    optimizer_steps, skipped, stopped = p.optimizer_steps, p.skipped, False

    def snapshot() -> EpochProgress:  # host syncs: only when a checkpoint is written
        return EpochProgress(
            batches=done + step + 1,
            optimizer_steps=optimizer_steps,
            skipped=skipped,
            norm_sum=float(norm_sum),
            loss_sum=float(sums.loss_sum),
            correct=int(sums.correct),
            count=int(sums.count),
            seconds=p.seconds + time.perf_counter() - start,
            pass_start=done,
        )

    step = -1
    try:
        with torch.set_grad_enabled(train):
            for step, batch in enumerate(bar):
                x = batch[0].to(backend.device, non_blocking=True)
                y = batch[1].to(backend.device, non_blocking=True)
                with backend.autocast():
                    out = model(x)
                    per_sample = criterion(out, y)
                result = None
                if train:
                    backend.backward(per_sample.mean())
                    result = backend.step(optimizer, scheduler)
                    if result is not None:
                        optimizer_steps += 1
                        skipped += result.skipped
                        norm_sum += result.grad_norm.to(norm_sum.device)
                sums.update(per_sample, out.argmax(1) == y)
                # .item() waits for the GPU: only on the rank that shows the bar, every 10th step.
                if shows_bar and step % 10 == 0:
                    bar.set_postfix(loss=f"{per_sample.mean().item():.4f}")
                if result is not None and on_step is not None and on_step(snapshot, step + 1 == steps):
                    stopped = True
                    break
    except ParallelxError as exc:
        raise ParallelxError(_worker_message(str(exc))) from None
    finally:
        bar.close()
        if hasattr(batches, "close"):
            batches.close()  # a pass left early: the backend's window bookkeeping ends too
    if stopped:
        return {"stopped": True}
    result = sums.compute(backend)
    result["seconds"] = p.seconds + time.perf_counter() - start
    if train:
        result.update(
            lr=optimizer.param_groups[0]["lr"],
            steps=optimizer_steps,
            skipped=skipped,
            grad_norm=float(norm_sum) / max(1, optimizer_steps),
        )
    return result


def _worker_message(message: str) -> str:
    """The message of an error raised in a data-loader worker, without the
    worker's traceback that the DataLoader adds to it when it re-raises."""
    marker = "ParallelxError: "
    if "Original Traceback" in message and marker in message:
        return message.rsplit(marker, 1)[1].strip()
    return message


def evaluate_state_dict(model: nn.Module, dataset: Dataset, batch_size: int = 256) -> dict[str, float]:
    """Single-process evaluation of ``model`` on ``dataset`` (no backend):
    the reference the distributed val figures must equal."""
    model.eval()
    sums = MetricSums()
    criterion = nn.CrossEntropyLoss(reduction="none")
    with torch.no_grad():
        for x, y in DataLoader(dataset, batch_size=batch_size):
            out = model(x)
            sums.update(criterion(out, y), out.argmax(1) == y)
    return sums.compute()
