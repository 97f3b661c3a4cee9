"""ZeRO's runs of flattened elements as boxes of the tensor's own shape (``backends/_chunks.py``),
the cut its sharded checkpoints are written in: every run of every shape tried is covered exactly,
element for element, in order, by boxes that are each one contiguous run."""

from __future__ import annotations

import itertools

import torch

from backends._chunks import boxes


def test_boxes_cover_exactly_the_run_in_order():
    for shape in [(7,), (5, 3), (4, 3, 2), (2, 3, 2, 2), (1, 1, 5), (3, 1)]:
        n = 1
        for s in shape:
            n *= s
        index = torch.arange(n).reshape(shape)
        for start, stop in itertools.combinations(range(n + 1), 2):
            got = []
            for offsets, sizes in boxes(shape, start, stop):
                box = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].reshape(-1)
                assert torch.equal(box, torch.arange(int(box[0]), int(box[0]) + box.numel())), (shape, offsets, sizes)
                got += box.tolist()
            assert got == list(range(start, stop)), (shape, start, stop)
            assert len(boxes(shape, start, stop)) <= 2 * len(shape) - 1


def test_an_empty_run_and_a_scalar():
    assert boxes((4, 4), 5, 5) == []
    assert boxes((), 0, 1) == [((), ())]
