"""A last-resort timeout for backends whose collectives can wait forever.

Gloo and NCCL give up on a collective after the process group's timeout, so a
``ddp`` rank whose peer stalls fails by itself.  Horovod's Gloo controller
and DeepSpeed's CPU all-reduce (shared memory, polled) do not: a rank that is
alive but never reaches the next collective (stopped, deadlocked, stuck in
I/O) leaves every other rank waiting for good, and no launcher restarts a
job that never fails.  For those backends parallelx arms this watchdog
around each blocking call (backward, the optimizer step, the collectives,
DeepSpeed's forward): when one lasts longer than the backend's timeout, the
process reports which call and ends with :data:`EXIT_STALLED` (a grace of
a quarter of the timeout, at least 5 s, lets a framework's own timeout
error come first where there is one).  The launcher
then stops the other ranks, the stalled one included, and a launcher that
restarts (``torchrun --max-restarts``) starts the job again, to resume from
its last checkpoint.

The process ends with ``os._exit``: the waiting thread is inside the
framework's C++ code and cannot be interrupted, and an orderly shutdown
would wait for the very peer that stalled.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator

#: Exit status of a process that the watchdog ended (as ``timeout(1)`` uses).
EXIT_STALLED = 124


class Watchdog:
    """Ends this process when a watched call outlasts ``timeout_s``."""

    def __init__(self, timeout_s: float, rank: int) -> None:
        self.timeout_s = timeout_s
        self.rank = rank
        self._deadline: float | None = None
        self._what = ""
        self._started = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watch(self, what: str) -> Iterator[None]:
        """Arm for the block (nested blocks keep the outer deadline)."""
        if self._deadline is not None:
            yield
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="parallelx-watchdog", daemon=True)
            self._thread.start()
        self._what, self._started = what, time.monotonic()
        # A little past the timeout: where the framework has a timeout of its
        # own (Gloo's), its error, which says more, comes first.
        self._deadline = self._started + self.timeout_s + max(5.0, 0.25 * self.timeout_s)
        try:
            yield
        finally:
            self._deadline = None

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        tick = min(1.0, max(0.05, self.timeout_s / 20))
        while not self._stop.wait(tick):
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                waited = time.monotonic() - self._started
                sys.stderr.write(
                    f"parallelx: error: rank {self.rank}: {self._what} has waited {waited:.0f} s, longer than the "
                    f"timeout ({self.timeout_s:g} s; --timeout or $PARALLELX_TIMEOUT): another rank is stalled or "
                    f"gone. Ending this process (exit status {EXIT_STALLED}) so that the launcher stops the job, "
                    "or restarts it from its last checkpoint.\n"
                )
                sys.stderr.flush()
                os._exit(EXIT_STALLED)
