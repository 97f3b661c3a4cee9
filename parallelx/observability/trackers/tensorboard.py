"""``--logger tensorboard``: event files in ``<run dir>/tensorboard`` through
``torch.utils.tensorboard.SummaryWriter``: one writer (one event file) per run,
the hyperparameters in the same file (the HPARAMS tab, and a text table).
Open with ``tensorboard --logdir <run dir>``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from parallelx.observability.trackers.tracker import Scalars, Tracker


class TensorBoardTracker(Tracker):
    name = "tensorboard"
    requires_module = "tensorboard"
    install_hint = "pip install 'parallelx[trackers]' (or pip install tensorboard)"

    def open(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = self.run_dir / "tensorboard"
        self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=30)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        # SummaryWriter.add_hparams would open a second writer in a sub-directory
        # (a second event file for the same run): its three summaries go into this one.
        values = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in params.items()}
        writer = self._writer.file_writer
        assert writer is not None  # made with the SummaryWriter
        for summary in hparams(values, {}):
            writer.add_summary(summary)
        table = "\n".join(f"| {k} | {v} |" for k, v in values.items())
        self._writer.add_text("hyperparameters", "| name | value |\n|---|---|\n" + table, 0)

    def log_metrics(self, metrics: Scalars, step: int, wall_time: float) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step, walltime=wall_time)

    def flush(self) -> None:
        self._writer.flush()

    def close(self, *, failed: bool = False) -> None:
        self._writer.close()
