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

Elsewhere ``train()`` runs once; a backend that can do better (Horovod)
overrides these hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class ElasticHooks:
    """``Backend.run_elastic`` and ``elastic_commit``, as a backend without elastic worlds has them."""

    def _require_init(self) -> None:  # Backend's
        raise NotImplementedError

    def run_elastic(self, train: Callable[[], T]) -> T:
        """Run ``train()``, again in the new world after a lost rank where the
        launcher can change the world (``horovodrun --min-np --max-np``);
        elsewhere once.  ``train`` builds everything afresh each time and
        resumes from ``parallelx.latest_checkpoint`` (docs/failures.md, "Surviving
        failures").  Returns what ``train()`` returned."""
        self._require_init()
        return train()

    def elastic_commit(self) -> None:
        """Mark the checkpoint just saved as where an elastic run goes back to
        (hosts join or leave here).  Every rank calls it; elsewhere a no-op."""
        self._require_init()
