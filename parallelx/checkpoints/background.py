"""Training-state checkpoints written in the background (``asynchronous=True``, ``--checkpoint-async``).

A synchronous save stops every rank until its files are written (and uploaded).  An
asynchronous one blocks each rank only while it *stages* its state, after the save's collectives: every
tensor of it copied into memory nothing else holds (pinned on CUDA, so the copy runs at the
bus's speed).  Some tensors the state parts hand a save share memory with live ones (a
buffer, an optimizer's state on the CPU, a loop's own value), which the next steps update
in place: the copy is what gets written, so no later update can reach the files.  The
extra memory while a save is in flight is the rank's checkpoint state, once.  A
thread of each rank then writes its files; once every rank has written, rank 0 publishes
the checkpoint (the folder's rename, or the commit record in a store) on a thread of its
own.  Until then the checkpoint is not complete and nothing reads it
(:func:`parallelx.checkpoints.trainstate.is_complete`).

The ranks learn where the save stands without a collective of its own: the flags ride on
the one all-reduce the :class:`parallelx.Checkpointer` already runs at every step (the
preemption flag's), so every rank sees the same sums at the same step::

    [written on how many ranks, failed on how many ranks, published, publishing failed]

* all ranks written: rank 0 starts publishing;
* published: the save is complete on every rank at that step (an elastic run's commit);
* a failure anywhere: every rank raises the same :class:`ParallelxError` at that step,
  naming the checkpoint, the rank and the cause; the previous complete checkpoint stays
  the latest, and ``--resume auto`` continues from it.

A save waits for the previous one first (:func:`wait`, a collective), and so do the end of
the run (``Backend.shutdown``, the Checkpointer's ``with`` block) and a preemption.  A
thread rather than a process: the writer spends its time in ``torch.save``'s file writes
and the store's uploads, which release the GIL (measured in docs/checkpoints.md).

Sharded checkpoints (each rank's own shards, written by ``torch.distributed.checkpoint``)
are staged the same way: each rank copies its local shards, their global layout kept
(``StateIO.copy_shards``), and the writer runs DCP's write of the copies.  DCP's own
collectives (the plans, the index) go over a Gloo group of the writers' own
(:func:`writer_group`), never the training's.
"""

from __future__ import annotations

import datetime as _dt
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from parallelx.errors import ParallelxError, first_line
from parallelx.parts.stateio import map_tensors
from parallelx.storage import Location, show

if TYPE_CHECKING:
    from parallelx.backend import Backend

__all__ = ["PendingSave", "pending", "poll", "stage", "wait", "writer_group"]

#: Flags per rank, in the order they are reduced (summed) over the ranks.
WRITTEN, WRITE_FAILED, PUBLISHED, PUBLISH_FAILED = range(4)
FLAGS = 4

# The save in flight of each backend (one at most: a save waits for the previous one).
_PENDING: weakref.WeakKeyDictionary[Any, PendingSave] = weakref.WeakKeyDictionary()
# Each backend's process group for background writes (writer_group).
_GROUPS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def stage(obj: Any, copies: Callable[[Any, Callable[[torch.Tensor], torch.Tensor]], Any] | None = None) -> Any:
    """``obj`` with every tensor copied into CPU memory that nothing else holds: what the
    background writer writes, whatever the training does next.  From a GPU into pinned
    memory, then one synchronisation (the copies run asynchronously until then).
    ``copies(obj, copy)`` applies ``copy`` to each tensor's memory where ``obj`` holds
    sharded tensors (a backend's :meth:`StateIO.copy_shards`); by default every tensor is copied whole."""
    cuda = False

    def copy(x: torch.Tensor) -> torch.Tensor:
        nonlocal cuda
        x = x.detach()
        if x.device.type == "cuda":
            cuda = True
            out = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=True)
            return out.copy_(x, non_blocking=True)
        return x.to("cpu", copy=True)

    out = (copies or map_tensors)(obj, copy)
    if cuda:
        torch.cuda.synchronize()
    return out


def writer_group(backend: Backend) -> Any:
    """A process group of the backend's ranks for the collectives of a sharded checkpoint's write
    (DCP's plans and index) in the background: a group of its own (Gloo, whose collectives run on
    the CPU), so they never interleave with the training's on the default group.  Made once per
    backend, the first time a save needs it (a collective: every rank saves at the same step);
    None without torch.distributed (DCP then writes without collectives)."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    group = _GROUPS.get(backend)
    if group is None:
        group = dist.new_group(backend="gloo", timeout=_dt.timedelta(seconds=backend.run.timeout_s))
        _GROUPS[backend] = group
    return group


class PendingSave:
    """One rank's side of a checkpoint being written in the background."""

    def __init__(
        self,
        backend: Backend,
        final: Location,
        write: Callable[[], None],
        publish: Callable[[], None],
        on_complete: Callable[[], None],
    ) -> None:
        self.backend, self.final = backend, final
        self._publish, self._on_complete = publish, on_complete
        self.write_error: str | None = None
        self.publish_error: str | None = None
        self._written = threading.Event()
        self._published = threading.Event()
        self._publisher: threading.Thread | None = None
        self._writer = threading.Thread(target=self._run, args=(write,), name="parallelx-checkpoint", daemon=True)
        self._writer.start()

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
        except BaseException as exc:  # reported to every rank at the next step (or wait)
            self.write_error = f"{type(exc).__name__}: {first_line(exc)}"
        finally:
            self._written.set()

    def _run_publish(self) -> None:
        try:
            self._publish()
        except BaseException as exc:
            self.publish_error = f"{type(exc).__name__}: {first_line(exc)}"
        finally:
            self._published.set()

    def flags(self) -> list[int]:
        """This rank's flags (see the module), read without waiting."""
        out = [0] * FLAGS
        if self._written.is_set():
            out[WRITE_FAILED if self.write_error else WRITTEN] = 1
        if self._published.is_set():
            out[PUBLISH_FAILED if self.publish_error else PUBLISHED] = 1
        return out

    def advance(self, summed: list[int]) -> bool:
        """Act on the flags summed over the ranks (the same on every rank): True once complete.
        Raises on every rank when any rank failed."""
        if summed[WRITE_FAILED] or summed[PUBLISH_FAILED]:
            self._fail()
        if summed[PUBLISHED]:
            self._complete()
            return True
        if summed[WRITTEN] == self.backend.world_size and self.backend.is_main() and self._publisher is None:
            self._publisher = threading.Thread(target=self._run_publish, name="parallelx-publish", daemon=True)
            self._publisher.start()
        return False

    def wait(self) -> None:
        """Until the save is complete or has failed, on every rank (a collective)."""
        self._writer.join()
        summed = _reduce(self.backend, self.flags())
        if summed[WRITE_FAILED]:
            self._fail()
        if self.backend.is_main() and self._publisher is None:
            self._run_publish()  # here and now: the others wait for it below
        elif self._publisher is not None:
            self._publisher.join()
        summed = _reduce(self.backend, self.flags())
        if summed[PUBLISH_FAILED]:
            self._fail()
        self._complete()

    def _fail(self) -> None:
        _PENDING.pop(self.backend, None)
        mine = self.write_error or self.publish_error
        every = self.backend.all_gather_object(mine)
        causes = "; ".join(f"rank {r}: {e}" for r, e in enumerate(every) if e)
        raise ParallelxError(
            f"checkpoint {show(self.final)} was not completed: writing it in the background failed ({causes}); "
            "the previous complete checkpoint stays the latest (--resume auto continues from it)"
        )

    def _complete(self) -> None:
        _PENDING.pop(self.backend, None)
        self._on_complete()


def _reduce(backend: Backend, flags: list[int]) -> list[int]:
    t = torch.tensor(flags, dtype=torch.int64)
    if backend.world_size > 1:
        t = backend.all_reduce(t, op="sum")
    return [int(v) for v in t.tolist()]


def pending(backend: Backend) -> PendingSave | None:
    """The save of ``backend`` still in flight, if any."""
    return _PENDING.get(backend)


def track(save: PendingSave) -> None:
    """Follow ``save`` until it completes; the backend's shutdown waits for it."""
    _PENDING[save.backend] = save
    finish = save.backend.run.on_shutdown
    if not any(isinstance(f, _Finish) for f in finish):
        finish.append(_Finish(save.backend))


class _Finish:
    """``backend.shutdown()``'s wait for its save in flight (one per backend)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = weakref.ref(backend)

    def __call__(self) -> None:
        backend = self.backend()
        if backend is not None:
            wait(backend)


def poll(backend: Backend, also: list[int]) -> list[int]:
    """``also`` summed over the ranks, with the save in flight's flags in the same all-reduce
    (advanced: started publishing, completed, or raised on every rank).  A collective."""
    save = pending(backend)
    if save is None:
        return _reduce(backend, also) if also else []
    summed = _reduce(backend, [*also, *save.flags()])
    save.advance(summed[len(also) :])
    return summed[: len(also)]


def wait(backend: Backend) -> None:
    """Wait for ``backend``'s save in flight, if any, to complete (a collective: every rank
    calls it, as they call the save)."""
    save = pending(backend)
    if save is not None:
        save.wait()
