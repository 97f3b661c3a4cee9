"""The benchmark's statistics on hand-made step times: the bootstrap interval
over rounds, and the pairing of rounds when a launch failed.  No launches."""

from __future__ import annotations

import random

import pytest

from benchmarks.run import overheads, round_interval, scaling


def row(impl: str, rounds: dict[int, list[float]], *, nproc: int = 2, case: str = "lenet-32px-b256") -> dict:
    times = [t for r in sorted(rounds) for t in rounds[r]]
    medians = [sorted(rounds[r])[len(rounds[r]) // 2] for r in sorted(rounds)]
    median = sorted(times)[len(times) // 2]
    return {"impl": impl, "nproc": nproc, "case_id": case, "base_id": case, "model": "lenet", "batch": 256,
            "threads": 1, "rounds": sorted(rounds), "round_step_times_s": [rounds[r] for r in sorted(rounds)],
            "repeat_medians_s": medians, "median_step_s": median, "p10_step_s": min(times),
            "images_per_s": nproc * 256 / median}


def noisy_rounds(scale: float, n: int, seed: int) -> dict[int, list[float]]:
    """Per-round step times whose level moves from round to round, as a
    shared machine's does; ``scale`` multiplies every step."""
    rng = random.Random(seed)
    out = {}
    for r in range(n):
        level = 0.030 * (1 + 0.15 * rng.random())
        out[r] = [scale * level * (1 + 0.02 * rng.random()) for _ in range(21)]
    return out


def test_a_constant_ratio_has_a_zero_width_interval():
    base = noisy_rounds(1.0, 6, seed=1)
    slow = {r: [1.25 * t for t in ts] for r, ts in base.items()}
    lo, hi = round_interval(row("px-ddp", slow), row("raw-ddp", base), lambda x, y: x / y)
    assert lo == pytest.approx(1.25) and hi == pytest.approx(1.25)


def test_the_interval_contains_the_estimate_and_narrows_with_more_rounds():
    def width(n: int) -> float:
        a, b = row("px-ddp", noisy_rounds(1.0, n, seed=2)), row("raw-ddp", noisy_rounds(1.0, n, seed=3))
        lo, hi = round_interval(a, b, lambda x, y: x / y)
        assert lo <= a["median_step_s"] / b["median_step_s"] <= hi
        return hi - lo

    assert width(40) < width(5)


def test_rounds_are_paired_by_number_when_one_launch_failed():
    base = {r: [0.03 + 0.001 * r] * 5 for r in range(4)}
    px = {r: [1.1 * t for t in ts] for r, ts in base.items() if r != 1}  # round 1's px launch failed
    (o,) = overheads([row("px-ddp", px), row("raw-ddp", base)])
    assert o["repeat_ratios"] == pytest.approx([1.1, 1.1, 1.1])
    assert o["ci95"] == pytest.approx([1.1, 1.1])


def test_too_few_rounds_give_no_interval():
    two = {0: [0.03] * 5, 1: [0.031] * 5}
    assert round_interval(row("px-ddp", two), row("raw-ddp", two), lambda x, y: x / y) is None


def test_scaling_interval_brackets_the_speedup():
    one = noisy_rounds(1.0, 8, seed=4)
    two = {r: [1.1 * t for t in ts] for r, ts in one.items()}  # 2 processes: 10 % slower steps, twice the images
    rows = [row("raw-ddp", two), row("raw-ddp", one, nproc=1)]
    (sc,) = scaling(rows)
    entry = sc["same_threads"]
    assert entry["speedup"] == pytest.approx(2 / 1.1, rel=0.02)
    lo, hi = entry["ci95"]
    assert lo == pytest.approx(2 / 1.1) and hi == pytest.approx(2 / 1.1)
