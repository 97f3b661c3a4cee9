"""What a cluster environment is: where this process's place in the job comes from.

A launcher or scheduler (torchrun, horovodrun, the deepspeed launcher, a
plain set of ``RANK``/``WORLD_SIZE`` variables, or nothing at all) tells each
process its rank, the size of the world, its place on its machine and where
the rendezvous is.  How that is read is one small :class:`ClusterEnvironment`
per launcher, detected once and handed to whichever backend was chosen; how a
backend then averages gradients is none of its business.  A backend declares
the environments it can run in (``Backend.environments``).
"""

from __future__ import annotations

import abc
import os
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from parallelx.errors import LaunchError


@dataclass(frozen=True)
class World:
    """This process's place in the job, as its environment gives it."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    #: The rendezvous of ``torch.distributed`` (None where the environment has none).
    master_addr: str | None = None
    master_port: int | None = None


class ClusterEnvironment(abc.ABC):
    """One launcher's or scheduler's way of telling a process where it stands."""

    #: Short name, shown by ``python -m parallelx env`` and in errors (``torchrun``).
    name: ClassVar[str] = ""
    #: The backend ``--backend auto`` picks in this environment.
    default_backend: ClassVar[str] = "ddp"
    #: Detection order: the most specific environment is tried first.
    priority: ClassVar[int] = 0
    #: True where the environment creates the process group itself before the
    #: script runs and destroys it afterwards: a backend adopts that group and
    #: leaves it alone at shutdown.
    owns_process_group: ClassVar[bool] = False
    #: Where such a group's timeout is set, since ``--timeout`` cannot reach it.
    group_timeout: ClassVar[str] = ""

    def __init__(self, environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None) -> None:
        self.environ: Mapping[str, str] = os.environ if environ is None else environ
        self.argv: Sequence[str] = argv if argv is not None else []

    @classmethod
    @abc.abstractmethod
    def detect(cls, environ: Mapping[str, str], argv: Sequence[str]) -> bool:
        """True when this process was started by this environment."""

    @abc.abstractmethod
    def world(self) -> World:
        """Rank, sizes and rendezvous, read from the environment."""

    @classmethod
    def auto_backend(cls) -> str:
        """The backend ``--backend auto`` picks here."""
        return cls.default_backend

    def why(self) -> str:
        """One line: what in the environment gave it away (for ``python -m parallelx env``)."""
        return ""

    def hint(self) -> str:
        """What to add to a backend's launch line when it cannot form its world
        here (``"; ..."``, or nothing)."""
        return ""

    def check_devices(self, gpus: int) -> None:
        """Raise :class:`LaunchError` when the processes on this machine and the
        ``gpus`` each sees cannot go together (0: no GPU is used)."""

    def checkpoint_saved(self, path: Path, step: int) -> None:
        """A training-state checkpoint is complete at ``path`` (every rank calls
        this, once per checkpoint): for an environment that keeps checkpoints
        itself and restarts from them (Ray Train)."""

    def restored_checkpoint(self) -> Path | None:
        """The checkpoint the environment restarted this run from, where the
        run's own directory has none (a replacement on another machine)."""
        return None

    def after_network_loss(self, master_answers: bool) -> str:
        """What becomes of the job now that a machine of it no longer answers
        (the end of the error line that names it); ``master_answers``: whether
        MASTER_ADDR's machine still answers from here.  An environment whose
        launcher would wait for the lost machine for long may act here."""
        return "once it is back, run the same command with --resume auto to continue from the last checkpoint"

    def export(self, environ: MutableMapping[str, str] | None = None) -> None:
        """Set the ``torch.distributed`` variables (``RANK``, ``WORLD_SIZE``,
        ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``)
        that ``init_process_group("env://")`` and DeepSpeed read, where the
        environment gives them under other names.  Variables already set win."""
        target = os.environ if environ is None else environ
        w = self.world()
        values = {
            "RANK": w.rank,
            "WORLD_SIZE": w.world_size,
            "LOCAL_RANK": w.local_rank,
            "LOCAL_WORLD_SIZE": w.local_world_size,
            "MASTER_ADDR": w.master_addr,
            "MASTER_PORT": w.master_port,
        }
        for key, value in values.items():
            if value is not None and key not in target:
                target[key] = str(value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.world()})"


def int_var(environ: Mapping[str, str], *names: str, default: int | None = None) -> int:
    """The first of ``names`` that is set, as an int (``default`` when none is)."""
    for name in names:
        value = environ.get(name)
        if value not in (None, ""):
            try:
                return int(str(value))
            except ValueError:
                raise LaunchError(f"${name} must be an integer, got {value!r}") from None
    if default is None:
        raise LaunchError(f"none of {', '.join('$' + n for n in names)} is set")
    return default


def distributed_world(environ: Mapping[str, str], *local_sizes: str, local_default: int | None = None) -> World:
    """The world ``torch.distributed``'s variables describe (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); the processes on this machine
    from the first of ``local_sizes`` that is set, else ``local_default`` (the
    world size when None)."""
    size = int_var(environ, "WORLD_SIZE")
    local = int_var(environ, *local_sizes, default=size if local_default is None else local_default)
    return World(
        rank=int_var(environ, "RANK"),
        world_size=size,
        local_rank=int_var(environ, "LOCAL_RANK", default=0),
        local_world_size=local,
        master_addr=environ.get("MASTER_ADDR"),
        master_port=int_var(environ, "MASTER_PORT", default=0) or None,
    )
