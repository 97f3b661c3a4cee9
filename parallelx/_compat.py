"""The module paths of parallelx 0.3, importable for one more release.

0.4 moved the flat modules of ``parallelx/`` into packages by concern (docs/changes.md has
the table).  ``import parallelx.trainstate`` (or ``from parallelx import loop``, or
``python -m parallelx.ray``) still works, with a :class:`DeprecationWarning` that names the
new path, and gives the very module object of the new path: one copy of every class, so
``isinstance`` and pickles agree whichever path a caller used.  The old paths go in the
next release.

``parallelx/__init__.py`` installs :data:`FINDER` at the front of :data:`sys.meta_path`: in
front of the path finder, which would otherwise find ``parallelx.tracking.monitor`` a second
time inside ``parallelx.tracking``'s (that is, ``parallelx.observability``'s) folder.

Standard library only: this module is imported before anything else of parallelx.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import CodeType, ModuleType

#: Old module path -> new module path (0.3 -> 0.4).
MOVED: dict[str, str] = {
    f"parallelx.{old}": f"parallelx.{new}"
    for old, new in {
        "protocol": "backend",
        "local": "strategies.single_process",
        "process_group": "strategies.process_group",
        "collectives": "parts.collectives",
        "gather": "parts.gather",
        "gradsync": "parts.gradsync",
        "precision": "parts.precision",
        "stateio": "parts.stateio",
        "elastic": "parts.elastic",
        "watchdog": "parts.watchdog",
        "lockstep": "parts.lockstep",
        "loop": "parts.loop",
        "sampler": "parts.sampler",
        "state": "parts.state",
        "checkpoint": "parts.portable",
        "metrics": "training.metrics",
        "preempt": "training.preemption",
        "main_process": "training.main_process",
        "trainstate": "checkpoints.trainstate",
        "sharded": "checkpoints.sharded",
        "launch": "launching.launchers",
        "runner": "launching.runner",
        "network": "launching.network",
        "ray": "launching.ray_train",
        "envreport": "launching.envreport",
        "environments": "launching.environments",
        "environments.base": "launching.environments.environment",
        "environments.local": "launching.environments.no_launcher",
        "environments.ray": "launching.environments.ray_worker",
        "environments.deepspeed_launcher": "launching.environments.deepspeed_launcher",
        "environments.envvars": "launching.environments.envvars",
        "environments.horovodrun": "launching.environments.horovodrun",
        "environments.slurm": "launching.environments.slurm",
        "environments.torchelastic": "launching.environments.torchelastic",
        "units": "transforms.units",
        "compiling": "transforms.compiling",
        "activations": "transforms.activations",
        "batchnorm": "transforms.batchnorm",
        "buffers": "transforms.buffers",
        "throughput": "observability.throughput",
        "profiling": "observability.profiling",
        "tracking": "observability",
        "tracking.monitor": "observability.monitor",
        "tracking.options": "observability.options",
        "tracking.base": "observability.trackers.tracker",
        "tracking.registry": "observability.trackers.catalog",
        "tracking.csv": "observability.trackers.csv",
        "tracking.mlflow": "observability.trackers.mlflow",
        "tracking.tensorboard": "observability.trackers.tensorboard",
        "tracking.wandb": "observability.trackers.wandb",
        "checkprobe": "check.probe",
        "virtualworld": "check.world",
    }.items()
}

#: The old packages: a name inside one that is not in :data:`MOVED` is looked up in the new package.
_OLD_PACKAGES = ("parallelx.environments", "parallelx.tracking")


def new_name(old: str) -> str | None:
    """The module path that replaced ``old``, or None when ``old`` is not an old path."""
    if old in MOVED:
        return MOVED[old]
    for package in _OLD_PACKAGES:
        if old.startswith(package + "."):
            return MOVED[package] + old[len(package) :]
    return None


def _warn(old: str, new: str) -> None:
    # stacklevel 3 is the importing line (1 is here, 2 the loader): the warnings module skips importlib's frames.
    warnings.warn(
        f"{old} is deprecated and goes in the next release: import {new} instead",
        DeprecationWarning,
        stacklevel=3,
    )


class _OldPathLoader(importlib.abc.Loader):
    """Loads an old path as the new path's module itself (nothing is executed a second time)."""

    def __init__(self, old: str, new: str, new_spec: importlib.machinery.ModuleSpec) -> None:
        self.old = old
        self.new = new
        self.new_spec = new_spec
        self.own_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        _warn(self.old, self.new)
        module = importlib.import_module(self.new)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the new path's import ran the module); give it back its own ``__spec__``.

        The import system keeps the module's ``__name__``, ``__file__`` and ``__path__`` but sets
        ``__spec__`` to the old path's between :meth:`create_module` and this call."""
        module.__spec__ = self.own_spec

    def get_code(self, fullname: str) -> CodeType | None:
        """The new module's code, for ``python -m <old path>`` (runpy runs it as ``__main__``)."""
        _warn(self.old, self.new)
        loader = self.new_spec.loader
        if not isinstance(loader, importlib.abc.InspectLoader):
            raise ImportError(f"cannot run {self.old}: {self.new} has no code to run", name=fullname)
        return loader.get_code(self.new)

    def is_package(self, fullname: str) -> bool:
        return self.new_spec.submodule_search_locations is not None


class OldPathFinder(importlib.abc.MetaPathFinder):
    """Finds every old module path of :data:`MOVED`, and names inside the old packages."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = new_name(fullname)
        if new is None:
            return None
        new_spec = importlib.util.find_spec(new)
        if new_spec is None:
            return None
        spec = importlib.machinery.ModuleSpec(
            fullname,
            _OldPathLoader(fullname, new, new_spec),
            origin=new_spec.origin,
            is_package=new_spec.submodule_search_locations is not None,
        )
        if new_spec.submodule_search_locations is not None:
            spec.submodule_search_locations = list(new_spec.submodule_search_locations)
        spec.has_location = new_spec.has_location
        return spec


FINDER = OldPathFinder()


def install() -> None:
    """Put :data:`FINDER` first on :data:`sys.meta_path` (once)."""
    if not any(isinstance(f, OldPathFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, FINDER)


install()
