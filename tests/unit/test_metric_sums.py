"""MetricSums without correctness (a language model's loss), and its sums
carried through a checkpoint: at the same world size each rank's own, at
another the totals on rank 0, the global figures unchanged either way."""

from __future__ import annotations

import pytest
import torch

from parallelx import MetricSums, ParallelxError, ShardedSampler
from parallelx.parts.mesh import Mesh


def test_loss_only_counts_the_loss_and_leaves_accuracy_out():
    sampler = ShardedSampler(range(5), num_replicas=2, rank=1, shuffle=False)  # positions 1, 3 real, one padding
    sums = MetricSums(sampler)
    list(iter(sampler))
    sums.update(torch.tensor([1.0, 3.0, 100.0]), None)
    result = sums.compute()
    assert result == {"loss": 2.0, "count": 2}, "the padding duplicate is left out, no accuracy is made up"


def test_a_fresh_metric_still_reports_accuracy_as_before():
    assert MetricSums().compute().keys() == {"loss", "count", "acc", "correct"}


def test_mixing_loss_only_and_correctness_is_an_error():
    sums = MetricSums()
    sums.update(torch.ones(2), None)
    with pytest.raises(ParallelxError, match="correct was None before and is a tensor now"):
        sums.update(torch.ones(2), torch.ones(2, dtype=torch.bool))
    other = MetricSums()
    other.update(torch.ones(2), torch.ones(2, dtype=torch.bool))
    with pytest.raises(ParallelxError, match="correct was given before and is None now"):
        other.update(torch.ones(2), None)


def _parts(world: int, losses: torch.Tensor, correct: torch.Tensor | None) -> list[MetricSums]:
    parts = []
    for rank in range(world):
        m = MetricSums()
        m.update(losses[rank::world], None if correct is None else correct[rank::world])
        parts.append(m)
    return parts


class _World:
    """What MetricSums asks of a backend here: its rank and size (no collective is called)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.mesh = Mesh.whole(rank, world_size, None)  # the data-parallel coordinates are the world's


@pytest.mark.parametrize("correct", [None, torch.tensor([1, 0, 1, 1, 0, 1, 0], dtype=torch.bool)])
def test_state_dict_continues_each_ranks_sums_or_gives_rank_0_the_totals(correct):
    losses = torch.tensor([0.1, 0.7, 1.3, 0.2, 2.9, 0.05, 1.1], dtype=torch.float32)
    parts = _parts(2, losses, correct)
    state = {"ranks": [p.state_dict()["ranks"][0] for p in parts]}  # what state_dict(backend) gathers
    total = MetricSums()
    total.update(losses, correct)
    expected = total.compute()

    same = [MetricSums() for _ in range(2)]
    for rank, m in enumerate(same):
        m.load_state_dict(state, _World(rank, 2))
        assert float(m.loss_sum) == float(parts[rank].loss_sum) and int(m.count) == int(parts[rank].count)
    smaller = MetricSums()
    smaller.load_state_dict(state, _World(0, 1))
    larger = [MetricSums() for _ in range(3)]
    for rank, m in enumerate(larger):
        m.load_state_dict(state, _World(rank, 3))
    for ranks in (same, [smaller], larger):
        merged = MetricSums()
        merged.load_state_dict({"ranks": [m.state_dict()["ranks"][0] for m in ranks]})
        got = merged.compute()
        assert got["count"] == expected["count"] and got["loss"] == pytest.approx(expected["loss"], rel=1e-12)
        assert ("acc" in got) == (correct is not None) and got.get("acc") == expected.get("acc")
    assert [int(m.count) for m in larger] == [7, 0, 0]


def test_a_state_that_is_not_one_says_so():
    with pytest.raises(ParallelxError, match="not a MetricSums state"):
        MetricSums().load_state_dict({"sums": [1, 2]})
