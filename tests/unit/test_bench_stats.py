"""The benchmark's planning, statistics and summary on hand-made inputs: the
launch order, the bootstrap interval over rounds, the pairing of rounds when
a launch failed, the same-process blocks.  No launches."""

from __future__ import annotations

import json
import random

import pytest

from benchmarks import plan, report, stats


def row(impl: str, rounds: dict[int, list[float]], *, nproc: int = 2, case: str = "lenet-32px-b256") -> dict:
    out = {
        "impl": impl,
        "nproc": nproc,
        "case_id": case,
        "base_id": case,
        "model": "lenet",
        "batch": 256,
        "threads": 1,
        **stats.timing(sorted(rounds), [rounds[r] for r in sorted(rounds)]),
    }
    out["images_per_s"] = nproc * 256 / out["median_step_s"]
    return out


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
    lo, hi = stats.round_interval(row("px-ddp", slow), row("raw-ddp", base), lambda x, y: x / y)
    assert lo == pytest.approx(1.25) and hi == pytest.approx(1.25)


def test_the_interval_contains_the_estimate_and_narrows_with_more_rounds():
    def width(n: int) -> float:
        a, b = row("px-ddp", noisy_rounds(1.0, n, seed=2)), row("raw-ddp", noisy_rounds(1.0, n, seed=3))
        lo, hi = stats.round_interval(a, b, lambda x, y: x / y)
        assert lo <= a["median_step_s"] / b["median_step_s"] <= hi
        return hi - lo

    assert width(40) < width(5)


def test_rounds_are_paired_by_number_when_one_launch_failed():
    base = {r: [0.03 + 0.001 * r] * 5 for r in range(4)}
    px = {r: [1.1 * t for t in ts] for r, ts in base.items() if r != 1}  # round 1's px launch failed
    (o,) = stats.overheads([row("px-ddp", px), row("raw-ddp", base)])
    assert o["per_round"] == pytest.approx([1.1, 1.1, 1.1])
    assert o["ci95"] == pytest.approx([1.1, 1.1])
    assert o["max_abs_weight_diff"] is None  # no weight files given: not compared, not passed


def test_too_few_rounds_give_no_interval():
    two = {0: [0.03] * 5, 1: [0.031] * 5}
    assert stats.round_interval(row("px-ddp", two), row("raw-ddp", two), lambda x, y: x / y) is None


def test_scaling_interval_brackets_the_speedup():
    one = noisy_rounds(1.0, 8, seed=4)
    two = {r: [1.1 * t for t in ts] for r, ts in one.items()}  # 2 processes: 10 % slower steps, twice the images
    (sc,) = stats.scaling([row("raw-ddp", two), row("raw-ddp", one, nproc=1)])
    entry = sc["same_threads"]
    assert entry["speedup"] == pytest.approx(2 / 1.1, rel=0.02)
    assert entry["ci95"] == pytest.approx([2 / 1.1, 2 / 1.1])


def test_same_process_blocks_pair_up_and_steps_average_over_ranks():
    # Two ranks, three blocks of two steps each; parallelx 5 % slower in every block.
    plain = [[[0.010, 0.012], [0.020, 0.022], [0.030, 0.032]], [[0.012, 0.010], [0.022, 0.020], [0.032, 0.030]]]
    reports = [
        {
            "impl": "same-deepspeed",
            "case_id": "lenet-32px-b32",
            "max_abs_weight_diff": 0.0,
            "blocks": {"plain": p, "parallelx": [[1.05 * t for t in b] for b in p]},
        }
        for p in plain
    ]
    s = stats.same_process(reports)
    assert (s["impl"], s["baseline"], s["how"], s["nproc"]) == ("px-deepspeed", "raw-deepspeed", "same process", 2)
    assert s["per_round"] == pytest.approx([1.05] * 3) and s["ci95"] == pytest.approx([1.05, 1.05])
    assert s["baseline_median_step_s"] == pytest.approx(0.021)  # the mean of the two ranks' step times
    assert s["steps_per_round"] == 2 and s["weights_equal"] and s["weights_passed"]
    reports[1]["max_abs_weight_diff"] = 1e-3
    assert not stats.same_process(reports)["weights_passed"]


def test_launches_alternate_and_each_comparison_stays_together():
    machine = plan.Machine(gpus=0, cores=2, nproc=2, threads_n=1, threads_1=2, comm="gloo", bind_cores=True)
    preset = plan.PRESETS["quick"]
    jobs = plan.schedule(
        preset,
        ["ddp", "horovod", "scaling", "same-process"],
        ["lenet"],
        machine,
        control=("ddp", "horovod"),
        same_process=("ddp",),
    )
    rounds = [
        [j.impl for j in jobs if j.repeat == r and j.nproc == 2 and not j.impl.startswith("same-")]
        for r in range(preset.repeats)
    ]
    assert rounds[0] == ["raw-ddp", "px-ddp", "ctl-ddp", "raw-horovod", "px-horovod", "ctl-horovod"]
    assert rounds[1] == ["px-ddp", "ctl-ddp", "raw-ddp", "px-horovod", "ctl-horovod", "raw-horovod"]
    singles = [j for j in jobs if j.nproc == 1]
    assert {j.impl for j in singles} == {"raw-ddp", "px-ddp"} and all(j.threads == 2 for j in singles)
    # A 1-process run measures both baselines: all the cores' threads, and one process's share.
    assert {c.threads for c in singles[0].cases} == {None, 1}
    assert jobs[-1].impl == "same-ddp" and jobs[-1].extra_args == ("--blocks", str(preset.same_blocks))
    assert all(c.save_weights == (j.repeat == 0) for j in jobs if not j.impl.startswith("same-") for c in j.cases)


def test_summary_is_compact_and_keeps_the_headline_numbers():
    base = noisy_rounds(1.0, 6, seed=5)
    rows = [row("px-ddp", {r: [1.01 * t for t in ts] for r, ts in base.items()}), row("raw-ddp", base)]
    comparison = {**stats.overheads(rows)[0], **stats.weights(0.0)}
    meta = {
        "command": "python -m benchmarks.run",
        "started": "now",
        "wall_s": 1.0,
        "hardware": {"arch": "x86_64", "cpu": "cpu", "cores": 2, "memory_gib": 1.0, "gpus": []},
        "versions": {"torch": "2"},
        "machine": {"nproc": 2, "threads_n": 1, "threads_1": 2, "comm": "gloo"},
    }
    text = report.compact_json(
        report.summary({"meta": meta, "runs": rows, "comparisons": [comparison], "scaling": [], "failures": []})
    )
    assert len(text.splitlines()) < 20
    (c,) = json.loads(text)["comparisons"]
    assert c["ratio"] == pytest.approx(1.01, abs=1e-3) and c["rounds"] == 6 and c["weights_equal"] is True
