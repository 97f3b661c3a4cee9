"""Preemption: stop every rank together at a step boundary when the job is told to stop.

A scheduler or a launcher that stops a job sends SIGTERM first (torchrun
sends it to every worker's process group, the deepspeed launcher to every
worker's process tree) and SIGKILL some time later (30 s for both).  A
process that dies on the SIGTERM loses everything since its last
checkpoint; one that finishes its step, saves and exits loses nothing::

    with parallelx.Preemption() as preempt:
        for step, batch in enumerate(loader):
            ...
            if preempt.should_stop(backend):       # every rank, once per optimizer step
                save_training_state(backend, run_dir, ...)
                break

:class:`parallelx.Checkpointer` does this (and the saving and resuming) for a loop.

The signal only sets a flag (the handler runs between two Python
statements, never inside a collective); :meth:`Preemption.should_stop`
all-reduces that flag, so the ranks agree even when the signal reached only
some of them, or reached them at different steps.  Further SIGTERMs are
ignored: a worker often gets the signal twice (sent to the whole process
group, then forwarded by the launcher), and the launcher's SIGKILL after
its grace period still ends a process that hangs.

Processes forked after the handler is installed (DataLoader workers)
inherit it, so the signal that torchrun sends to the whole process group
does not kill them under the training loop; they leave when the loader
shuts them down or their parent is gone.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from parallelx.backend import Backend

__all__ = ["Preemption"]


class Preemption:
    """Catch ``signals`` (SIGTERM by default) while the ``with`` block runs.

    :attr:`requested` is this process's own flag; :meth:`should_stop` is the
    collective answer every rank acts on.  Outside the main thread (where
    Python cannot install handlers) it is inactive and says so through
    :attr:`active`; the flag can still be set with :meth:`request`."""

    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM,)) -> None:
        self.signals = tuple(signals)
        self.requested = False
        #: ``time.monotonic()`` of the first signal, None before.
        self.requested_at: float | None = None
        self.signal: signal.Signals | None = None
        self.active = False
        self._previous: dict[signal.Signals, Callable[[int, FrameType | None], Any] | int | None] = {}

    def request(self, signum: signal.Signals | int = signal.SIGTERM) -> None:
        """Ask for a stop as the signal would (tests, or a script's own reasons)."""
        if not self.requested:
            self.requested, self.requested_at = True, time.monotonic()
            self.signal = signal.Signals(signum)

    @property
    def reason(self) -> str:
        """Why the loop stops, in words, for the line that says so: this
        process's signal, or a request that reached another rank only."""
        return self.signal.name if self.signal is not None else "a stop request on another rank"

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.request(signum)

    def should_stop(self, backend: Backend | None = None) -> bool:
        """True on every rank when any rank has been asked to stop.  **A
        collective when ``backend`` has more than one rank**: every rank must
        call it at the same point of the loop (once per optimizer step)."""
        flag = torch.tensor([1 if self.requested else 0])
        if backend is not None and backend.world_size > 1:
            flag = backend.all_reduce(flag, op="max")
        return bool(int(flag.item()))

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
            self.active = True
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()
        self.active = False
