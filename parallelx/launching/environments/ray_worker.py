"""Ray Train: the script runs as a ``TorchTrainer`` worker function.

Ray's worker group has already called ``init_process_group`` (Gloo, or NCCL
with GPUs) before the function runs, and destroys the group after it
returns: the backend adopts that group and leaves it alone.  Its variables
look like torchrun's (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ...), so Ray is
tried before torchrun and the plain variables; what decides is Ray's own
context, ``ray.train.get_context()``, which exists only inside a training
function.  Rank and sizes come from that context.

Checkpoints reach Ray: every training-state checkpoint is reported
(``ray.train.report``, rank 0 with the checkpoint directory, the others
without), so that a worker group Ray replaces after a failure
(``FailureConfig(max_failures=K)``) resumes from it, on another machine too.
``python -m parallelx.launching.ray_train`` builds the trainer; see :mod:`parallelx.launching.ray_train`.

Ray is optional (``pip install parallelx[ray]``): nothing here imports it
unless this process already has (a Ray worker always has).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

from parallelx.launching.environments.environment import ClusterEnvironment, World, distributed_world


def _train_context() -> Any | None:
    """Ray Train's context of this worker, or None outside a training function."""
    if "ray" not in sys.modules:
        return None
    try:
        import ray.train

        context = ray.train.get_context()
        context.get_world_size()
    except Exception:  # outside a training function, or another Ray's API
        return None
    return context


class RayTrain(ClusterEnvironment):
    name = "ray"
    default_backend = "ddp"
    # Above every launcher: a Ray worker's variables are torchrun's look-alikes.
    priority = 50
    owns_process_group = True
    group_timeout = "Ray's TorchConfig(timeout_s=...); python -m parallelx.launching.ray_train --timeout S sets it"

    @classmethod
    def detect(cls, environ: Mapping[str, str], argv: Sequence[str]) -> bool:
        return "RANK" in environ and _train_context() is not None

    def world(self) -> World:
        ctx = _train_context()
        if ctx is None:  # told to use Ray outside a training function: its variables are all there is
            return distributed_world(self.environ, "LOCAL_WORLD_SIZE")
        port = self.environ.get("MASTER_PORT")
        return World(
            rank=ctx.get_world_rank(),
            world_size=ctx.get_world_size(),
            local_rank=ctx.get_local_rank(),
            local_world_size=ctx.get_local_world_size(),
            master_addr=self.environ.get("MASTER_ADDR"),
            master_port=int(port) if port else None,
        )

    def why(self) -> str:
        ctx = _train_context()
        where = f"world rank {ctx.get_world_rank()} of {ctx.get_world_size()}" if ctx is not None else "no context"
        return f"ray.train.get_context(): {where}"

    def export(self, environ: MutableMapping[str, str] | None = None) -> None:
        """Nothing: Ray set the variables and made the process group."""

    def checkpoint_saved(self, path: Path, step: int) -> None:
        import ray.train

        # Every worker reports, the same number of times (a barrier of Ray's);
        # rank 0's directory holds every rank's files.
        checkpoint = ray.train.Checkpoint.from_directory(str(path)) if self.world().rank == 0 else None
        ray.train.report({"step": step}, checkpoint=checkpoint)

    def restored_checkpoint(self) -> Path | None:
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return None
        # On a local (or shared, mounted) storage path every rank reads it in place.
        if type(checkpoint.filesystem).__name__ == "LocalFileSystem":
            return Path(checkpoint.path)
        return Path(checkpoint.to_directory())
