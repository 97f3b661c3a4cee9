"""The bookkeeping every loop needs to resume exactly and to stop on a preemption, in one part.

A loop that resumes must store, besides its weights, where it stood (epoch,
micro-batch inside it, optimizer step), the sampler's position, the random
generators, the scheduler, its partial sums and its own values (history, best
figure); it must skip what a resumed run already trained and, on SIGTERM,
save on every rank at the same step and stop.  :class:`Checkpointer` holds
all of that by name, over :func:`parallelx.save_training_state`,
:func:`~parallelx.load_training_state` and :class:`parallelx.Preemption`::

    ckpt = parallelx.Checkpointer(backend, out_dir, every=args.checkpoint_every, keep=3,
                                  model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler,
                                  best_acc=0.0)             # plain values: read and set as ckpt["best_acc"]
    ckpt.resume(args.resume)                                # "auto", a path, or None (a fresh start)
    with ckpt:                                              # SIGTERM: save at the next step, then stop
        for epoch in ckpt.epochs(args.epochs):              # from the epoch a resumed run stopped in
            for x, y in ckpt.batches(loader):               # the rest of that epoch, then whole ones
                ...
                if backend.step(optimizer, scheduler) is not None and ckpt.step():
                    return                                  # preempted: saved on every rank
            ...                                             # validate; at the body's end an epoch checkpoint
    if ckpt.preempted:                                      # (preempted at an epoch's end)
        return

Every rank runs every line: saving and the preemption check are collectives.
"""

from __future__ import annotations

import copy
import itertools
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
from torch import nn

from parallelx import storage
from parallelx.checkpoints import background
from parallelx.checkpoints.trainstate import (
    STATE_FILE,
    SUBDIR,
    is_complete,
    latest_checkpoint,
    load_training_state,
    plain,
    save_training_state,
)
from parallelx.errors import ParallelxError
from parallelx.parts.portable import is_optimizer
from parallelx.parts.sampler import ShardedSampler
from parallelx.storage import Location
from parallelx.training.ema import EMA, refuse_averaged_model
from parallelx.training.metrics import MetricSums
from parallelx.training.preemption import Preemption

if TYPE_CHECKING:
    from parallelx.backend import Backend

__all__ = ["Checkpointer"]

T = TypeVar("T")
#: The counters a Checkpointer stores (its position); a checkpoint without them is another loop's.
COUNTERS = ("epoch", "batch", "global_step", "epoch_steps")
#: The key of ``extra`` that holds the Checkpointer's own non-integer state.
OWN = "checkpointer"


class Checkpointer:
    """Training-state checkpoints of a loop, resumed exactly, saved when due or preempted::

        ckpt = parallelx.Checkpointer(backend, run_dir, every=100, model=model, optimizer=optimizer, sampler=sampler)
        ckpt.resume("auto")
        with ckpt:
            for epoch in ckpt.epochs(10):
                for x, y in ckpt.batches(loader):
                    ...
                    if backend.step(optimizer) is not None and ckpt.step():
                        return

    ``parts`` are given by name: models, optimizers, schedulers (anything with
    ``state_dict``/``load_state_dict``), weight averages (:class:`~parallelx.EMA`,
    stored whole, resumed into each rank's share), :class:`~parallelx.ShardedSampler` s
    (the training data's: their position is the micro-batches :meth:`batches`
    gave), :class:`~parallelx.MetricSums` (an epoch's sums: zero at each new
    epoch, carried into a resumed one) and plain values (numbers, strings,
    lists, dicts, tensors: read and set as ``ckpt[name]``).  ``per_epoch``
    are plain values that go back to the given ones at each new epoch.

    ``every``: a checkpoint every that many optimizer steps, besides one at
    every epoch's end.  Checkpoints are written only when ``every`` is given
    or :meth:`resume` was called with a value (``enabled`` decides otherwise),
    as ``--checkpoint-every`` and ``--resume`` do in the recipes; so is
    SIGTERM handled (inside ``with ckpt:``).  ``directory`` is the run's: the
    checkpoints go to ``directory/checkpoints/``, the newest ``keep`` kept.

    ``asynchronous=True`` (``--checkpoint-async``): a save blocks only while each rank copies its state
    into CPU memory; the files are written in the background, and the checkpoint is complete a few
    steps later (:mod:`parallelx.checkpoints.background`, whose flags ride on the per-step
    preemption all-reduce: no collective is added).  The end of the ``with`` block, a preemption and
    the next save wait for it; a failed write raises on every rank at the step it is known.
    """

    def __init__(
        self,
        backend: Backend,
        directory: str | os.PathLike[str],
        *,
        every: int | None = None,
        keep: int = 3,
        enabled: bool | None = None,
        per_epoch: Mapping[str, Any] | None = None,
        asynchronous: bool = False,
        **parts: Any,
    ) -> None:
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ParallelxError(f"Checkpointer(every=...) must be an int >= 1 or None, got {every!r}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ParallelxError(f"Checkpointer(keep=...) must be an int >= 1, got {keep!r}")
        self.backend = backend
        #: The run's directory: a local Path, or a URL (``s3://bucket/run``) as a str.
        self.directory: Location = storage.location(directory)
        self.every, self.keep, self.asynchronous = every, keep, bool(asynchronous)
        self.models: dict[str, nn.Module] = {}
        self.optimizers: dict[str, Any] = {}
        self.schedulers: dict[str, Any] = {}
        self.samplers: dict[str, ShardedSampler] = {}
        self.sums: dict[str, MetricSums] = {}
        self.emas: dict[str, EMA] = {}
        self.values: dict[str, Any] = {}
        for name, part in parts.items():
            self._add(name, part)
        self._epoch_values = {n: plain(v, n) for n, v in (per_epoch or {}).items()}
        clash = sorted(set(self._epoch_values) & set(parts))
        if clash:
            raise ParallelxError(f"Checkpointer: {clash} given both as parts and per_epoch; give each name once")
        self.values.update(copy.deepcopy(self._epoch_values))
        #: The epoch in progress (from 1; one past the last when all are done), the
        #: micro-batches of it trained, the optimizer steps in all and in this epoch.
        self.epoch, self.batch, self.global_step, self.epoch_steps = 1, 0, 0, 0
        #: SIGTERM's flag; :meth:`step` asks every rank.
        self.preemption = Preemption()
        #: True once a preemption stopped the loop (after the checkpoint was written).
        self.preempted = False
        #: The checkpoint :meth:`resume` loaded, None on a fresh start.
        self.path: Location | None = None
        self._enabled = enabled
        self._in_flight: Location | None = None  # a checkpoint being written in the background
        self._resuming = False
        self._inside = self._armed = False
        self._seconds_before, self._started = 0.0, time.perf_counter()
        self._in_pass, self._pass_done = 0, False
        self._pass_length: int | None = None
        self._batch_size: int | None = None

    # ------------------------------------------------------------ the parts
    def _add(self, name: str, part: Any) -> None:
        if name == OWN:
            raise ParallelxError(f"Checkpointer: {OWN!r} is its own name; call the part something else")
        if isinstance(part, EMA):
            self.emas[name] = part
        elif isinstance(part, nn.Module):
            refuse_averaged_model(self.backend, part, f"Checkpointer({name}=...)")
            self.models[name] = part
        elif isinstance(part, ShardedSampler):
            self.samplers[name] = part
        elif isinstance(part, MetricSums):
            self.sums[name] = part
        elif is_optimizer(part):
            self.optimizers[name] = part
        elif callable(getattr(part, "state_dict", None)) and callable(getattr(part, "load_state_dict", None)):
            self.schedulers[name] = part
        else:
            try:
                self.values[name] = plain(part, name)
            except ParallelxError:
                raise ParallelxError(
                    f"Checkpointer: {name}= is a {type(part).__name__}, which is neither a model, optimizer, "
                    "scheduler, sampler, EMA, MetricSums nor a plain value (number, string, list, dict, tensor)"
                ) from None

    def __getitem__(self, name: str) -> Any:
        return self.values[self._known(name)]

    def __setitem__(self, name: str, value: Any) -> None:
        self.values[self._known(name)] = value

    def _known(self, name: str) -> str:
        if name not in self.values:
            raise ParallelxError(
                f"Checkpointer holds no value named {name!r} (it holds {sorted(self.values)}); "
                f"give it when making it: Checkpointer(..., {name}=...), so that checkpoints store it"
            )
        return name

    @property
    def enabled(self) -> bool:
        """Whether checkpoints are written and SIGTERM handled: ``enabled`` as
        given, else when ``every`` was given or :meth:`resume` asked to resume."""
        if self._enabled is not None:
            return self._enabled
        return self.every is not None or self._resuming

    @property
    def epoch_seconds(self) -> float:
        """Seconds spent in this epoch so far, the runs it resumes included."""
        return self._seconds_before + time.perf_counter() - self._started

    # -------------------------------------------------------------- resuming
    def resume(self, resume: str | os.PathLike[str] | None) -> Location | None:
        """Load the checkpoint ``resume`` names (what ``--resume`` gives): ``"auto"``
        is the latest in the run directory, or a fresh start when there is none; a
        path is a checkpoint directory, or a run directory whose latest is taken;
        None is a fresh start.  Every rank calls it (rank 0 decides, so every rank
        loads the same one).  Returns the checkpoint's path, or None."""
        if resume is None:
            return None
        self._resuming = True
        self._arm()
        path = self._find(str(resume))
        if path is None:
            self.backend.print(
                f"--resume auto: no checkpoint in {storage.show(storage.join(self.directory, SUBDIR))} yet; "
                "starting from the beginning"
            )
            return None
        info = load_training_state(self.backend, path, **self._parts(loading=True))
        meta = self._restore(path, info)
        self.path = path
        where = (
            f"epoch {self.epoch}, after micro-batch {self.batch} of it"
            if self.batch
            else f"the start of epoch {self.epoch}"
        )
        self.backend.print(
            f"resuming from {path}: {where}, optimizer step {self.global_step} "
            f"(written by {meta['backend']} with {meta['world_size']} process(es))"
        )
        return path

    def _find(self, resume: str) -> Location | None:
        found, error = None, None
        if self.backend.is_main():
            try:
                path = self._checkpoint_path(resume)
                found = None if path is None else str(path)
            except ParallelxError as exc:
                error = str(exc)
        found, error = self.backend.broadcast((found, error), src=0)
        if error is not None:
            raise ParallelxError(error)
        return None if found is None else storage.location(found)

    def _checkpoint_path(self, resume: str) -> Location | None:
        if resume == "auto":
            return latest_checkpoint(self.directory)
        path = storage.location(resume)
        if is_complete(path):
            return path
        latest = latest_checkpoint(path) if storage.is_remote(path) or Path(path).is_dir() else None
        if latest is None:
            raise ParallelxError(
                f"--resume {storage.show(path)}: no checkpoint there (expected a checkpoint directory holding {STATE_FILE}, or "
                f"an --out-dir with {SUBDIR}/); use --resume auto to start afresh when none exists"
            )
        return latest

    def _restore(self, path: Location, info: dict[str, Any]) -> dict[str, Any]:
        counters, extra = info["counters"], info["extra"]
        if any(k not in counters for k in COUNTERS) or not isinstance(extra, dict) or OWN not in extra:
            raise ParallelxError(
                f"checkpoint {path} was not written by a parallelx.Checkpointer (no loop state in it); "
                "resume from the loop's own checkpoints, or read it with parallelx.load_training_state"
            )
        missing = sorted(n for n in [*self.values, *self.sums] if n not in extra)
        if missing:
            raise ParallelxError(
                f"checkpoint {path} holds no {missing} (it holds {sorted(k for k in extra if k != OWN)}): "
                "it was written by another loop; resume with the loop that wrote it"
            )
        self.epoch, self.batch, self.global_step, self.epoch_steps = (int(counters[k]) for k in COUNTERS)
        for name, value in self.values.items():
            saved = extra[name]
            if isinstance(saved, torch.Tensor) and isinstance(value, torch.Tensor):
                saved = saved.to(value.device)  # loaded on the CPU
            self.values[name] = saved
        for name, sums in self.sums.items():
            sums.load_state_dict(extra[name], self.backend)
        self._seconds_before, self._started = float(extra[OWN]["seconds"]), time.perf_counter()
        meta: dict[str, Any] = info["meta"]
        return meta

    # ------------------------------------------------------------ the loop
    def epochs(self, count: int) -> Iterator[int]:
        """The epochs ``1..count`` still to train (from the one a resumed run
        stopped in).  When an epoch's body ends, the next one starts: the
        epoch's sums and ``per_epoch`` values go back to zero, and a checkpoint
        is written (if enabled); a preemption then ends the loop
        (:attr:`preempted`)."""
        while self.epoch <= count and not self.preempted:
            self._started = time.perf_counter()
            yield self.epoch
            self._end_epoch()

    def batches(self, loader: Iterable[T], *, limit: int | None = None, batch_size: int | None = None) -> _Pass[T]:
        """``backend.batches(loader)``, counted: the micro-batches of this
        epoch still to train, at most ``limit`` in the epoch (a resumed epoch
        counts those done before).  The samplers' position continues by
        itself; without a sampler part the batches already trained are
        skipped.  ``batch_size`` (default ``loader.batch_size``) turns the
        count into the samplers' position."""
        self._batch_size = batch_size if batch_size is not None else getattr(loader, "batch_size", None)
        if self.samplers and self.enabled and not isinstance(self._batch_size, int):
            raise ParallelxError(
                f"Checkpointer.batches: {type(loader).__name__} has no batch_size; give batch_size=... "
                "(the samples per micro-batch), which places the sampler in a checkpoint"
            )
        source: Iterable[T] = loader
        if self.batch and not self.samplers:  # a resumed epoch: what the loop trained before is skipped here
            source = _Skipped(loader, self.batch)
        length: int | None = len(source) if hasattr(source, "__len__") else None  # type: ignore[arg-type]
        if limit is not None:
            rest = max(1, limit - self.batch)
            length = rest if length is None else min(length, rest)
        return _Pass(lambda: self._iterate(source, length), length)

    def _iterate(self, loader: Iterable[T], length: int | None) -> Iterator[T]:
        self._in_pass, self._pass_length, self._pass_done = 0, length, False
        for item in self.backend.batches(loader, limit=length):
            self._in_pass += 1
            self.batch += 1
            yield item

    def step(self) -> bool:
        """Count an optimizer step (call it after each ``backend.step`` that
        stepped); save when ``every`` is due or a preemption arrived on any
        rank (a collective when enabled).  True: preempted, saved, stop now."""
        self.global_step += 1
        self.epoch_steps += 1
        if not self.enabled or self._in_pass == self._pass_length:  # the pass's last: the epoch's checkpoint follows
            return False
        stop = self._should_stop()
        if stop or (self.every is not None and self.global_step % self.every == 0):
            self.save(asynchronous=self.asynchronous and not stop)
        if stop:
            self._stopped()
        return stop

    def _end_epoch(self) -> None:
        self.epoch, self.batch, self.epoch_steps = self.epoch + 1, 0, 0
        self._pass_done, self._seconds_before, self._started = True, 0.0, time.perf_counter()
        self.values.update(copy.deepcopy(self._epoch_values))
        for sums in self.sums.values():
            sums.load_state_dict({"ranks": [{"loss_sum": 0.0, "correct": 0, "count": 0, "tracks_correct": None}]})
        if self.enabled:
            self.save(
                asynchronous=self.asynchronous
            )  # the pass is over (or cut by a limit): the next epoch starts at its beginning
            if self._should_stop():
                self._wait()
                self._stopped()

    def _should_stop(self) -> bool:
        """The preemption flag of every rank (one all-reduce per step), which also carries the
        flags of a checkpoint still written in the background."""
        preempted = 1 if self.preemption.requested else 0
        [anyone] = background.poll(self.backend, [preempted])
        self._settle()
        return anyone > 0

    def _settle(self) -> None:
        """Once the checkpoint written in the background is complete (the same step on every rank)."""
        if self._in_flight is not None and background.pending(self.backend) is None:
            self.backend.print(f"checkpoint {storage.show(self._in_flight)}: complete")
            self._in_flight = None
            self.backend.elastic_commit()  # an elastic run that loses a rank goes back to this checkpoint

    def _wait(self) -> None:
        background.wait(self.backend)
        self._settle()

    def _stopped(self) -> None:
        self.preempted = True
        self.backend.print(
            f"preempted ({self.preemption.reason}): checkpoint written at epoch {self.epoch}, step "
            f"{self.global_step}; run the same command with --resume auto to continue"
        )
        self.backend.barrier()

    # ---------------------------------------------------------------- saving
    def save(self, *, asynchronous: bool = False) -> Location:
        """Write a checkpoint of where the loop stands now (every rank calls it); with
        ``asynchronous``, in the background (see the class)."""
        self._wait()  # the one in flight first (save_training_state would too): its line before this one's
        extra: dict[str, Any] = dict(self.values)
        for name, sums in self.sums.items():
            extra[name] = sums.state_dict(self.backend)  # every rank's sums (a collective)
        extra[OWN] = {"seconds": self.epoch_seconds}
        saved = save_training_state(
            self.backend,
            self.directory,
            step=self.global_step,
            counters={
                "epoch": self.epoch,
                "batch": self.batch,
                "global_step": self.global_step,
                "epoch_steps": self.epoch_steps,
            },
            keep=self.keep,
            extra=extra,
            asynchronous=asynchronous,
            **self._parts(loading=False),
        )
        where = f"epoch {self.epoch}, micro-batch {self.batch}, step {self.global_step}"
        if asynchronous:
            self.backend.print(f"checkpoint {storage.show(saved)}: {where} (writing in the background)")
            self._in_flight = saved
            return saved
        self.backend.print(f"checkpoint {storage.show(saved)}: {where}")
        self.backend.elastic_commit()  # an elastic run that loses a rank goes back to this checkpoint
        return saved

    def _sampler_state(self, sampler: ShardedSampler) -> dict[str, Any]:
        if self._pass_done:
            return dict(sampler.state_dict(consumed=sampler.num_samples))
        if self._in_pass and self._batch_size is not None:
            return dict(sampler.state_dict(consumed=min(self._in_pass * self._batch_size, sampler.num_samples)))
        return dict(sampler.state_dict())

    def _parts(self, *, loading: bool) -> dict[str, Any]:
        """The keyword arguments of save/load_training_state: one of each in the
        one-model layout, else every part by name."""
        samplers: dict[str, Any] = (
            dict(self.samplers) if loading else {n: self._sampler_state(s) for n, s in self.samplers.items()}
        )
        emas = {"emas": self.emas} if self.emas else {}
        if len(self.models) == 1 and len(self.optimizers) == 1 and len(self.schedulers) <= 1 and len(samplers) <= 1:
            return {
                "model": next(iter(self.models.values())),
                "optimizer": next(iter(self.optimizers.values())),
                "scheduler": next(iter(self.schedulers.values()), None),
                "sampler": next(iter(samplers.values()), None),
                **emas,
            }
        return {
            "models": self.models,
            "optimizers": self.optimizers,
            "schedulers": self.schedulers,
            "samplers": samplers,
            **emas,
        }

    # --------------------------------------------------- SIGTERM, in a with
    def __enter__(self) -> Checkpointer:
        self._inside = True
        self._arm()
        return self

    def _arm(self) -> None:
        if self._inside and self.enabled and not self._armed:
            self.preemption.__enter__()
            self._armed = True

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self._wait()  # the last checkpoint complete before the loop's end
        if self._armed:
            self.preemption.__exit__(exc_type, exc, tb)
        self._inside = self._armed = False


class _Pass(Generic[T]):
    """One epoch's batches from :meth:`Checkpointer.batches`, with a length (for progress bars)."""

    def __init__(self, iterate: Callable[[], Iterator[T]], length: int | None) -> None:
        self.iterate, self.length = iterate, length

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("the loader has no len() and no limit was given")
        return self.length

    def __iter__(self) -> Iterator[T]:
        return self.iterate()


class _Skipped(Generic[T]):
    """``loader`` without its first ``skip`` items (a resumed epoch without a sampler part)."""

    def __init__(self, loader: Iterable[T], skip: int) -> None:
        self.loader, self.skip = loader, skip

    def __len__(self) -> int:
        return max(0, len(self.loader) - self.skip)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[T]:
        return itertools.islice(iter(self.loader), self.skip, None)
