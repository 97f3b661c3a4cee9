"""``--logger mlflow``: one MLflow run per training run, through ``MlflowClient``
(no global ``mlflow.start_run`` state).

Where: ``$MLFLOW_TRACKING_URI`` when set (a server, ``http://host:5000``, or any
store URI), else a SQLite store in the run directory,
``sqlite:///<run dir>/mlflow.db`` (MLflow 3.7 made SQLite its default local
store; the ``./mlruns`` file store is kept for compatibility only).  The
experiment is ``$MLFLOW_EXPERIMENT_NAME`` or ``parallelx``.  Open the local
store with ``mlflow ui --backend-store-uri sqlite:///<run dir>/mlflow.db``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from parallelx.observability.trackers.tracker import Scalars, Tracker

#: MLflow's own limits (mlflow.utils.validation): entries per log_batch call, characters per parameter value.
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_PER_BATCH = 100
MAX_PARAM_VALUE = 6000
#: Characters MLflow accepts in a metric or parameter name; others become "_".
_UNSAFE = re.compile(r"[^\w\-. /:]")


def safe_name(name: str) -> str:
    return _UNSAFE.sub("_", name)


class MLflowTracker(Tracker):
    name = "mlflow"
    requires_module = "mlflow"
    install_hint = "pip install 'parallelx[trackers]' (or pip install mlflow)"

    def open(self) -> None:
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(self.run_dir / 'mlflow.db').resolve()}"
        self.tracking_uri = uri
        self._client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "parallelx"
        experiment = self._client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        elif uri.startswith("sqlite:"):
            # Artifacts beside the store, not in ./mlruns of whatever directory the job started in.
            artifacts = (self.run_dir / "mlartifacts").resolve().as_uri()
            experiment_id = self._client.create_experiment(name, artifact_location=artifacts)
        else:
            experiment_id = self._client.create_experiment(name)
        self.run_id: str = self._client.create_run(experiment_id, run_name=self.run_name).info.run_id
        self._pending: list[Any] = []

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(safe_name(k), str(v)[:MAX_PARAM_VALUE]) for k, v in params.items()]
        for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=items[i : i + MAX_PARAMS_PER_BATCH])

    def log_metrics(self, metrics: Scalars, step: int, wall_time: float) -> None:
        from mlflow.entities import Metric

        ms = int(wall_time * 1000)
        self._pending += [Metric(safe_name(k), float(v), ms, int(step)) for k, v in metrics.items()]

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for i in range(0, len(pending), MAX_METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=pending[i : i + MAX_METRICS_PER_BATCH])

    def close(self, *, failed: bool = False) -> None:
        try:
            self.flush()
        finally:
            self._client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
