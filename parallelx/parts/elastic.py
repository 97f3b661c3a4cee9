"""Elastic runs: a job that outlives a lost rank, where the launcher can
change the world while it runs (``horovodrun --min-np --max-np
--host-discovery-script``).

When a rank dies, or hosts join or leave, every remaining rank leaves
``train()`` by an exception, the backend joins the new world (its rank, world
size and local sizes change) and calls ``train()`` again.  So ``train`` starts
from the beginning each time: it builds and wraps the model and optimizer,
makes the sampler (sharded for the world it runs in), loads
``parallelx.latest_checkpoint(run_dir)`` when there is one, and every few steps
calls ``parallelx.save_training_state`` then ``backend.elastic_commit()``.
Whatever was done after the last checkpoint is done again, by the new world;
models and optimizers of an earlier call must not be used again.

Elsewhere ``train()`` runs once (:class:`Elastic`); a backend that can do
better (Horovod) gives a subclass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Elastic:
    """The elastic part of a backend whose world does not change while the job
    runs: ``train()`` runs once, and a commit marks nothing."""

    def run(self, train: Callable[[], T]) -> T:
        """Run ``train()``; again in the new world after a lost rank where the
        launcher can change the world.  Returns what ``train()`` returned."""
        return train()

    def commit(self) -> None:
        """Mark the checkpoint just saved as where an elastic run goes back to.
        Every rank calls it."""
