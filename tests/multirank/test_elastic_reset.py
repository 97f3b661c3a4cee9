"""An elastic reset inside a running process (Horovod's): after the world shrinks, everything
that reduces over the ranks or splits the data by rank must use the new world.

The launcher test (tests/system/test_elastic.py) kills a rank under real elastic horovodrun;
this one pins the facade's side of it with thread-ranks: two ranks train, rank 1 leaves, rank 0
is told the new world of one (as Horovod's elastic part tells it) and its metrics, sampler and
collectives must no longer wait for, or sum, the rank that is gone."""

from __future__ import annotations

import threading

import torch
from threads import Meeting, ThreadBackend, ThreadCollectives, no_forensics

from parallelx import MetricSums
from parallelx.strategy import Joined


def test_metrics_and_sampler_follow_the_world_after_an_elastic_reset() -> None:
    meeting = Meeting(2)
    seen: dict[str, object] = {}
    errors: list[BaseException] = []
    left = threading.Event()

    def rank(r: int) -> None:
        try:
            with ThreadBackend(meeting, r) as backend:
                sums = MetricSums()
                sums.update(torch.full((3,), float(r + 1)), torch.ones(3, dtype=torch.bool))
                before = sums.compute(backend)
                if r == 1:
                    left.set()
                    return
                assert left.wait(20)
                # Horovod's elastic part re-initialises and hands the run its new world.
                alone = Meeting(1)
                comm = ThreadCollectives(alone, 0)
                backend.strategy.run.rejoin(Joined(0, 1, 0, 1, torch.device("cpu"), comm))
                after = sums.compute(backend)
                seen.update(
                    before=before["count"],
                    after=after["count"],
                    loss=after["loss"],
                    mesh=(backend.mesh.data_rank, backend.mesh.data_size),
                    shard=len(backend.make_sampler(list(range(10)), shuffle=False)),
                )
        except BaseException as exc:
            errors.append(exc)
            meeting.barrier.abort()

    with no_forensics():
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not errors, errors
    assert seen["before"] == 6  # both ranks' three samples
    assert seen["after"] == 3  # rank 0's own only: rank 1 is gone
    assert seen["loss"] == 1.0
    assert seen["mesh"] == (0, 1)
    assert seen["shard"] == 10  # the whole dataset is rank 0's now
