"""``--profile-steps A:B``: ``torch.profiler`` for optimizer steps A to B, on every rank.

Steps are counted from 1 and both ends are included (``2:3`` records the
second and the third optimizer step; ``5`` alone means ``5:5``).  The
profiler starts when the loop asks for the first batch of step A and stops
when step B has stepped the optimizer; each step is a ``step N`` range in
the trace.  Then each rank writes its Chrome trace,
``<run dir>/profile/trace_rank<R>.json`` (open it in https://ui.perfetto.dev
or chrome://tracing), and rank 0 prints the table of the operations that
took the most time.

``--memory-snapshot`` (GPUs only) also records the CUDA caching allocator's
history over the same steps, ``<run dir>/profile/memory_rank<R>.pickle``
(drag it onto https://pytorch.org/memory_viz).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from parallelx.errors import ParallelxError
from parallelx.log import warn

#: Rows of the operations table rank 0 prints.
TABLE_ROWS = 15
#: Allocator events kept by the memory history (its own default is 100,000 as well).
MEMORY_ENTRIES = 100_000


def parse_steps(text: str | tuple[int, int] | None) -> tuple[int, int] | None:
    """``"A:B"`` (or ``"A"``, or ``(A, B)``) as ``(A, B)`` with 1 <= A <= B."""
    if text is None or text == "":
        return None
    if isinstance(text, tuple):
        first, last = text
    else:
        m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", str(text))
        if m is None:
            raise ParallelxError(
                f"profile steps must look like A:B (optimizer steps A to B, counted from 1), got {text!r}"
            )
        first, last = int(m[1]), int(m[2] or m[1])
    if not 1 <= first <= last:
        raise ParallelxError(
            f"profile steps {first}:{last} are not a range of optimizer steps; expected 1 <= A <= B (e.g. 2:3)"
        )
    return first, last


class StepProfiler:
    """Starts and stops ``torch.profiler`` at the loop's marks, for steps ``first`` to ``last``.

    ``out_dir`` is asked for the directory when the profile is written (every
    rank calls :meth:`step_starting` and :meth:`step_done` at the same steps).
    """

    def __init__(
        self,
        steps: tuple[int, int],
        *,
        rank: int,
        device: torch.device,
        out_dir: Callable[[], Path],
        memory_snapshot: bool = False,
    ) -> None:
        self.first, self.last = steps
        self.rank = rank
        self.device = device
        self.out_dir = out_dir
        self.memory = memory_snapshot and device.type == "cuda"
        if memory_snapshot and not self.memory:
            warn(f"--memory-snapshot records the CUDA allocator: there is none on the {device.type}; skipped")
        self._prof: profile | None = None
        self._range: Any = None
        self.done = False
        #: What was written (the trace, the memory snapshot), for the caller to report.
        self.written: list[Path] = []

    @property
    def active(self) -> bool:
        return self._prof is not None

    def step_starting(self, step: int) -> None:
        """The loop asks for the first batch of optimizer step ``step`` (1-based)."""
        if self._prof is None and not self.done and self.first <= step <= self.last:
            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            if self.memory:
                torch.cuda.memory._record_memory_history(max_entries=MEMORY_ENTRIES)
            self._prof = profile(activities=activities, record_shapes=True)
            self._prof.start()
        if self._prof is not None and self._range is None:
            self._range = record_function(f"step {step}")
            self._range.__enter__()

    def step_done(self, step: int) -> None:
        """Optimizer step ``step`` is done; past the last one, write the profile."""
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self._prof is not None and step >= self.last:
            self._finish()

    def close(self) -> None:
        """The run ends: write what was recorded if the last step was never reached."""
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self._prof is not None:
            warn(f"the run ended before optimizer step {self.last}: the profile holds the steps it reached")
            self._finish()
        elif not self.done:
            warn(f"--profile-steps {self.first}:{self.last}: the run made fewer steps; nothing was profiled")

    def _finish(self) -> None:
        prof, self._prof = self._prof, None
        self.done = True
        assert prof is not None
        prof.stop()
        out = self.out_dir() / "profile"
        out.mkdir(parents=True, exist_ok=True)
        trace = out / f"trace_rank{self.rank}.json"
        prof.export_chrome_trace(str(trace))
        self.written.append(trace)
        if self.memory:
            snapshot = out / f"memory_rank{self.rank}.pickle"
            # torch's only API for the allocator's history is this underscored one
            # (documented in "Understanding CUDA Memory Usage"); no public one exists.
            torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.written.append(snapshot)
        if self.rank == 0:
            sort = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
            table = prof.key_averages().table(sort_by=sort, row_limit=TABLE_ROWS)
            print(
                f"profile of optimizer steps {self.first}:{self.last} (rank 0; every rank's trace is in {out}):\n{table}",
                flush=True,
            )
