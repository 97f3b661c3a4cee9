"""An elastic reset inside a running process (Horovod's): after the world shrinks, everything
that reduces over the ranks or splits the data by rank must use the new world.

The launcher test (tests/system/test_elastic.py) kills a rank under real elastic horovodrun;
this one pins the facade's side of it with thread-ranks: two ranks train, rank 1 leaves, rank 0
is told the new world of one (as Horovod's elastic part tells it) and its metrics, sampler and
collectives must no longer wait for, or sum, the rank that is gone."""

from __future__ import annotations

import threading

import torch
from threads import Meeting, ThreadCollectives, in_threads

from parallelx import Backend, MetricSums
from parallelx.strategy import Joined


def test_metrics_and_sampler_follow_the_world_after_an_elastic_reset() -> None:
    left = threading.Event()

    def body(backend: Backend) -> dict[str, object] | None:
        sums = MetricSums()
        sums.update(torch.full((3,), float(backend.rank + 1)), torch.ones(3, dtype=torch.bool))
        before = sums.compute(backend)
        if backend.rank == 1:
            left.set()
            return None
        assert left.wait(20)
        # Horovod's elastic part re-initialises and hands the run its new world.
        comm = ThreadCollectives(Meeting(1), 0)
        backend.strategy.run.rejoin(Joined(0, 1, 0, 1, torch.device("cpu"), comm))
        after = sums.compute(backend)
        return {
            "before": before["count"],
            "after": after["count"],
            "loss": after["loss"],
            "mesh": (backend.mesh.data_rank, backend.mesh.data_size),
            "shard": len(backend.make_sampler(list(range(10)), shuffle=False)),
        }

    seen = in_threads(2, body)[0]
    assert seen["before"] == 6  # both ranks' three samples
    assert seen["after"] == 3  # rank 0's own only: rank 1 is gone
    assert seen["loss"] == 1.0
    assert seen["mesh"] == (0, 1)
    assert seen["shard"] == 10  # the whole dataset is rank 0's now
