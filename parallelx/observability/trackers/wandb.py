"""``--logger wandb``: a Weights & Biases run in ``<run dir>/wandb``.

Offline unless configured otherwise: ``$WANDB_MODE`` (``online`` to upload as
the run goes; ``offline``, the default here, needs no network and no account:
upload later with ``wandb sync <run dir>/wandb/offline-run-*``).  The project
is ``$WANDB_PROJECT`` or ``parallelx``.  Every metric is plotted against
``step`` (the value given to ``log_metrics``), so that metrics logged on
different axes (optimizer steps, epochs) do not fight over W&B's own
monotonic step counter.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal, cast

from parallelx.errors import ParallelxError
from parallelx.observability.trackers.tracker import Scalars, Tracker

STEP = "step"
#: The modes W&B runs in.
MODES = ("online", "offline", "disabled", "shared")


class WandbTracker(Tracker):
    name = "wandb"
    requires_module = "wandb"
    install_hint = "pip install 'parallelx[trackers]' (or pip install wandb)"

    def open(self) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE") or "offline"
        if mode not in MODES:
            raise ParallelxError(f"WANDB_MODE is {mode!r}; W&B runs {', '.join(MODES)} (parallelx's default: offline)")
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "parallelx",
            name=self.run_name,
            dir=str(self.run_dir),
            mode=cast(Literal["online", "offline", "disabled", "shared"], mode),
        )
        self._run.define_metric(STEP, hidden=True)
        self._run.define_metric("*", step_metric=STEP)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self._run.config.update(dict(params), allow_val_change=True)

    def log_metrics(self, metrics: Scalars, step: int, wall_time: float) -> None:
        self._run.log({**metrics, STEP: step})

    def close(self, *, failed: bool = False) -> None:
        self._run.finish(exit_code=1 if failed else 0)
