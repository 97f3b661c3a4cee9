"""Tracker names and lookup, as :mod:`parallelx.registry` does for backends.

The built-in trackers are listed by module path, so nothing is imported until
one is asked for.  A third-party package adds its own through the
``parallelx.trackers`` entry-point group (``name = "pkg.module:Class"``, the
class a :class:`~parallelx.observability.Tracker`), or at run time with
:func:`register_tracker`; ``--logger NAME`` then selects it.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from importlib.metadata import entry_points

from parallelx.errors import ParallelxError
from parallelx.observability.trackers.tracker import Tracker

ENTRY_POINT_GROUP = "parallelx.trackers"

_BUILTIN: dict[str, str] = {
    "csv": "parallelx.observability.trackers.csv:CSVTracker",
    "tensorboard": "parallelx.observability.trackers.tensorboard:TensorBoardTracker",
    "mlflow": "parallelx.observability.trackers.mlflow:MLflowTracker",
    "wandb": "parallelx.observability.trackers.wandb:WandbTracker",
}
_REGISTERED: dict[str, str | type[Tracker]] = {}


def register_tracker(name: str, target: str | type[Tracker]) -> None:
    """Make ``name`` available to ``--logger``; ``target`` is a Tracker
    subclass or a ``"module:Class"`` path imported on first use."""
    _REGISTERED[name] = target


def _table() -> dict[str, str | type[Tracker]]:
    table: dict[str, str | type[Tracker]] = dict(_BUILTIN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        table.setdefault(ep.name, ep.value)
    table.update(_REGISTERED)
    return table


def available_trackers() -> list[str]:
    """Every name ``--logger`` accepts."""
    return list(_table())


def tracker_class(name: str) -> type[Tracker]:
    """The Tracker subclass registered as ``name`` (its module is imported; the
    tracker's own package is not)."""
    table = _table()
    if name not in table:
        raise ParallelxError(f"unknown logger {name!r}; valid loggers are: {', '.join(table)}")
    target = table[name]
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        try:
            target = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ParallelxError(f"logger {name!r} points to {table[name]!r}, which cannot be loaded: {exc}") from None
    if not (isinstance(target, type) and issubclass(target, Tracker)):
        raise ParallelxError(f"logger {name!r} resolves to {target!r}, which is not a parallelx.observability.Tracker")
    return target


def parse_loggers(loggers: str | Sequence[str] | None) -> tuple[str, ...]:
    """``"tensorboard,mlflow"`` or ``["tensorboard", "mlflow"]`` as a tuple of
    known names, each once, in order; None, ``""`` and ``"none"`` mean no tracker."""
    if loggers is None:
        return ()
    parts = loggers.split(",") if isinstance(loggers, str) else list(loggers)
    names: list[str] = []
    for part in parts:
        name = str(part).strip().lower()
        if name in ("", "none") or name in names:
            continue
        tracker_class(name)  # unknown names fail here, with the list of valid ones
        names.append(name)
    return tuple(names)


def check_available(names: Sequence[str]) -> None:
    """Fail now, with the install command, for a tracker whose package is missing."""
    for name in names:
        reason = tracker_class(name).unavailable_reason()
        if reason is not None:
            raise ParallelxError(f"logger {name!r} cannot run: {reason}")
