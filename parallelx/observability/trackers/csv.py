"""``--logger csv``: every logged value as a row of ``metrics.csv`` in the run
directory (``step,name,value,wall_time``: one row per value, so that metrics
logged at different steps or on different axes share one file), and the
hyperparameters in ``hparams.json``.  Needs no package; read it back with
``pandas.read_csv(path).pivot_table(index="step", columns="name", values="value")``."""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping
from typing import IO, Any

from parallelx.observability.trackers.tracker import Scalars, Tracker

HEADER = ("step", "name", "value", "wall_time")


class CSVTracker(Tracker):
    name = "csv"

    def open(self) -> None:
        path = self.run_dir / "metrics.csv"
        new = not path.exists() or path.stat().st_size == 0
        self._file: IO[str] = path.open("a", newline="")
        self._writer = csv.writer(self._file)
        if new:
            self._writer.writerow(HEADER)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        (self.run_dir / "hparams.json").write_text(json.dumps(dict(params), indent=2, default=str) + "\n")

    def log_metrics(self, metrics: Scalars, step: int, wall_time: float) -> None:
        # repr keeps every digit of a float64: what is read back equals what was logged.
        self._writer.writerows((step, name, repr(float(value)), f"{wall_time:.3f}") for name, value in metrics.items())

    def flush(self) -> None:
        self._file.flush()

    def close(self, *, failed: bool = False) -> None:
        self._file.close()
