"""A run directory in an object store (``--logger-dir s3://bucket/runs/exp1``): the trackers and
the profiler write into a local staging folder, and its files are copied to the URL as they
change: every ``every_s`` seconds from the trackers' thread (rank 0), and at the end on every
rank (each rank's profile traces).  A store has no append, so a changed file is uploaded whole;
an upload that fails is a warning, never an end to training, and the next copy tries again.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

from parallelx import storage
from parallelx.errors import first_line
from parallelx.log import warn


class Mirror:
    """A local staging folder (:meth:`make_local`), copied to ``url`` file by file as its files change."""

    def __init__(self, url: str, *, every_s: float = 30.0) -> None:
        self.url = url
        self.local: Path | None = None
        self.every_s = every_s
        self._sent: dict[Path, tuple[int, int]] = {}
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def make_local(self) -> Path:
        """The local staging folder (made at the first call): where the files are written."""
        if self.local is None:
            self.local = Path(tempfile.mkdtemp(prefix="parallelx-logs-"))
        return self.local

    def sync(self, *, force: bool = False) -> None:
        """Upload the files that changed since the last copy (at most every ``every_s`` seconds unless
        ``force``); a failed upload is said, and tried again next time."""
        if self.local is None or (not force and time.monotonic() - self._last < self.every_s):
            return
        with self._lock:
            self._last = time.monotonic()
            for f in sorted(p for p in self.local.rglob("*") if p.is_file()):
                stat = f.stat()
                mark = (stat.st_size, stat.st_mtime_ns)
                if self._sent.get(f) == mark:
                    continue
                target = storage.join(self.url, *f.relative_to(self.local).parts)
                try:
                    storage.upload(f, target)
                except Exception as exc:  # the run goes on; its files stay in the staging folder
                    warn(
                        f"copying the run's file to {storage.show(target)} failed: {first_line(exc)}; tried again later"
                    )
                    continue
                self._sent[f] = mark
