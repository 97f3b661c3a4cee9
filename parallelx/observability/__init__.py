"""Trackers, throughput and profiles: what a user watching a run sees.

- :class:`Monitor` (``backend.monitor``): ``backend.log_metrics`` and the
  loop's marks; it reads device values in batches, reduces across ranks
  when asked, and writes on rank 0 only, from a thread of its own.
- :class:`Tracker`: the seam behind which each destination sits, one small
  module each: :mod:`~parallelx.observability.trackers.csv`,
  :mod:`~parallelx.observability.trackers.tensorboard`, :mod:`~parallelx.observability.trackers.mlflow`,
  :mod:`~parallelx.observability.trackers.wandb`; third-party ones through the
  ``parallelx.trackers`` entry-point group (:mod:`~parallelx.observability.trackers.catalog`).
- :class:`MonitorOptions`: ``--logger``, ``--logger-dir``, ``--logger-every``,
  ``--peak-tflops``, ``--tokens-per-sample``, ``--profile-steps``, ``--memory-snapshot``.

docs/trackers.md is the user's guide.
"""

from parallelx.observability.monitor import Monitor
from parallelx.observability.options import DEFAULT_LOG_EVERY, MonitorOptions
from parallelx.observability.trackers.catalog import (
    ENTRY_POINT_GROUP,
    available_trackers,
    parse_loggers,
    register_tracker,
    tracker_class,
)
from parallelx.observability.trackers.tracker import Tracker

__all__ = [
    "DEFAULT_LOG_EVERY",
    "ENTRY_POINT_GROUP",
    "Monitor",
    "MonitorOptions",
    "Tracker",
    "available_trackers",
    "parse_loggers",
    "register_tracker",
    "tracker_class",
]
