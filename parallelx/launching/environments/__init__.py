"""Cluster environments: where a process's rank and world come from.

Detected once per process (:func:`detect_environment`) and handed to the
backend; ``--backend auto`` asks the environment which backend it means.
Built in, in the order they are tried: ``ray`` (a Ray Train worker),
``horovodrun``, ``deepspeed`` (its launcher), ``torchrun``, ``slurm`` (tasks of
an ``srun`` step), ``env`` (plain ``RANK``/``WORLD_SIZE`` variables) and
``local`` (no launcher).  More
register with :func:`register_environment`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from parallelx.errors import ParallelxError
from parallelx.launching.environments.deepspeed_launcher import DeepSpeedLauncher
from parallelx.launching.environments.environment import ClusterEnvironment, World
from parallelx.launching.environments.envvars import EnvVars
from parallelx.launching.environments.horovodrun import HorovodRun
from parallelx.launching.environments.no_launcher import Local
from parallelx.launching.environments.ray_worker import RayTrain
from parallelx.launching.environments.slurm import Slurm
from parallelx.launching.environments.torchelastic import TorchElastic

_ENVIRONMENTS: dict[str, type[ClusterEnvironment]] = {
    cls.name: cls for cls in (RayTrain, HorovodRun, DeepSpeedLauncher, TorchElastic, Slurm, EnvVars, Local)
}


def register_environment(cls: type[ClusterEnvironment]) -> None:
    """Make ``cls`` one of the environments :func:`detect_environment` tries (by its ``priority``)."""
    if not (isinstance(cls, type) and issubclass(cls, ClusterEnvironment)) or not cls.name:
        raise ParallelxError(f"register_environment needs a named ClusterEnvironment subclass, got {cls!r}")
    _ENVIRONMENTS[cls.name] = cls


def available_environments() -> list[str]:
    """Every environment's name, in the order they are tried."""
    return [cls.name for cls in sorted(_ENVIRONMENTS.values(), key=lambda c: -c.priority)]


def environment_class(name: str) -> type[ClusterEnvironment]:
    if name not in _ENVIRONMENTS:
        raise ParallelxError(f"unknown cluster environment {name!r}; known: {', '.join(available_environments())}")
    return _ENVIRONMENTS[name]


def detect_environment(
    environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None
) -> ClusterEnvironment:
    """The environment that started this process (``local`` when none did)."""
    env = os.environ if environ is None else environ
    args = sys.argv if argv is None else argv
    for name in available_environments():
        cls = _ENVIRONMENTS[name]
        if cls.detect(env, args):
            return cls(env, args)
    return Local(env, args)


__all__ = [
    "ClusterEnvironment",
    "World",
    "available_environments",
    "detect_environment",
    "environment_class",
    "register_environment",
]
