"""Trackers, throughput and profiles: what a user watching a run sees.

- :class:`Monitor` (``backend.monitor``): ``backend.log_metrics`` and the
  loop's marks; it reads device values in batches, reduces across ranks
  when asked, and writes on rank 0 only, from a thread of its own.
- :class:`Tracker`: the seam behind which each destination sits, one small
  module each: :mod:`~parallelx.tracking.csv`,
  :mod:`~parallelx.tracking.tensorboard`, :mod:`~parallelx.tracking.mlflow`,
  :mod:`~parallelx.tracking.wandb`; third-party ones through the
  ``parallelx.trackers`` entry-point group (:mod:`~parallelx.tracking.registry`).
- :class:`MonitorOptions`: ``--logger``, ``--logger-dir``, ``--logger-every``,
  ``--peak-tflops``, ``--tokens-per-sample``, ``--profile-steps``, ``--memory-snapshot``.

docs/trackers.md is the user's guide.
"""

from .base import Tracker
from .monitor import Monitor
from .options import DEFAULT_LOG_EVERY, MonitorOptions
from .registry import ENTRY_POINT_GROUP, available_trackers, parse_loggers, register_tracker, tracker_class

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
