"""From the workers' per-rank result files to the numbers in the report:
step times pooled over rounds, ratios with bootstrap intervals over rounds
(or same-process blocks), final weights compared, scaling.

The ranks of a job advance in lockstep (each waits for the others in the
gradient all-reduce, so their summed step times agree), which makes any
rank's step time the job's; a step's time is the mean over the ranks, which
evens out where each rank's timer happens to cut the shared wait.
"""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.plan import IMPLS, PAIRS, Job
from benchmarks.workload import MODELS, Case, result_path, weights_path

#: Final weights of parallelx and of the plain script must agree this closely
#: (max absolute difference).  The same math in the same order gives exactly
#: 0; a different order of float additions would give ~1e-7.
WEIGHT_ATOL = 1e-6
#: The overhead target: median step time parallelx / plain.
RATIO_TARGET = 1.02

Row = dict[str, Any]


def lockstep(per_rank: Iterable[list[float]]) -> list[float]:
    """Step i's time: the mean of step i over the ranks."""
    return [statistics.fmean(step) for step in zip(*per_rank)]


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank below) of ``values``."""
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def pooled(row: Row) -> list[float]:
    return [t for steps in row["round_step_times_s"] for t in steps]


def rank_reports(job: Job, work: Path, case: Case) -> list[dict[str, Any]]:
    """Every rank's result file of ``case``; fewer than ``job.nproc`` when a rank wrote none."""
    paths = [result_path(job.out(work), job.impl, case, r) for r in range(job.nproc)]
    return [json.loads(p.read_text()) for p in paths if p.is_file()]


def timing(rounds: list[int], round_steps: list[list[float]]) -> Row:
    """Round-by-round step times and the figures pooled over them."""
    row = {"rounds": rounds, "round_step_times_s": round_steps}
    times = pooled(row)
    return {**row, "median_step_s": statistics.median(times), "p10_step_s": quantile(times, 0.1)}


def collect(jobs: list[Job], work: Path) -> list[Row]:
    """One row per (implementation, process count, case): step times pooled
    over the rounds, and kept per round for the intervals."""
    rows: dict[tuple[str, int, str], Row] = {}
    for job in jobs:
        if job.error or IMPLS[job.impl].paired:
            continue
        for case in job.cases:
            reports = rank_reports(job, work, case)
            if len(reports) != job.nproc:
                continue
            row = rows.setdefault(
                (job.impl, job.nproc, case.id),
                {
                    "impl": job.impl,
                    "family": IMPLS[job.impl].family,
                    "nproc": job.nproc,
                    "threads": reports[0]["threads"],
                    "case_id": case.id,
                    "model": case.model,
                    "batch": case.batch,
                    "base_id": f"{case.model}-{case.image_size}px-b{case.batch}",
                    "image_size": case.image_size,
                    "device": reports[0]["device"],
                    "cores": [rep.get("cores") for rep in reports],
                    "rounds": [],
                    "round_step_times_s": [],
                    "peak_rss_mib": 0.0,
                    "peak_gpu_mib": None,
                },
            )
            row["rounds"].append(job.repeat)
            row["round_step_times_s"].append(lockstep(rep["step_times_s"] for rep in reports))
            row["peak_rss_mib"] = max(row["peak_rss_mib"], *(rep["peak_rss_mib"] for rep in reports))
            gpu = [rep["peak_gpu_mib"] for rep in reports if rep["peak_gpu_mib"] is not None]
            if gpu:
                row["peak_gpu_mib"] = max(row["peak_gpu_mib"] or 0.0, *gpu)
    out = []
    for row in rows.values():
        row.update(timing(row["rounds"], row["round_step_times_s"]))
        images = row["nproc"] * row["batch"]
        row["images_per_s"] = images / row["median_step_s"]
        row["epoch_s_projected"] = -(-MODELS[row["model"]]["train_images"] // images) * row["median_step_s"]
        out.append(row)
    order = list(IMPLS)
    out.sort(key=lambda r: (r["model"] != "lenet", r["batch"], -r["nproc"], -r["threads"], order.index(r["impl"])))
    return out


def round_interval(
    a: Row, b: Row, stat: Callable[[float, float], float], *, resamples: int = 2000, seed: int = 0
) -> list[float] | None:
    """95 % bootstrap interval of ``stat(median step of a, median step of b)``
    over the rounds: the rounds both rows ran in are drawn with replacement,
    each taking its step times of ``a`` and of ``b`` together, because the
    machine's state changes from launch to launch far more than from step to
    step.  None with fewer than 3 common rounds."""
    ta, tb = dict(zip(a["rounds"], a["round_step_times_s"])), dict(zip(b["rounds"], b["round_step_times_s"]))
    common = sorted(ta.keys() & tb.keys())
    if len(common) < 3:
        return None
    rng = random.Random(seed)
    values = []
    for _ in range(resamples):
        pick = rng.choices(common, k=len(common))
        values.append(
            stat(
                statistics.median([t for r in pick for t in ta[r]]), statistics.median([t for r in pick for t in tb[r]])
            )
        )
    values.sort()
    return [values[int(0.025 * (resamples - 1))], values[int(0.975 * (resamples - 1))]]


def compare(a: Row, b: Row, *, impl: str, baseline: str, how: str, case_id: str, nproc: int) -> Row:
    """``a`` against ``b``: the ratio of median step times, of the 10th
    percentiles (which a noisy machine disturbs less: interference only ever
    adds time), each round's own ratio and the 95 % interval."""
    tb = dict(zip(b["rounds"], b["round_step_times_s"]))
    per_round = [
        statistics.median(t) / statistics.median(tb[r]) for r, t in zip(a["rounds"], a["round_step_times_s"]) if r in tb
    ]
    return {
        "impl": impl,
        "baseline": baseline,
        "how": how,
        "case_id": case_id,
        "nproc": nproc,
        "median_step_s": a["median_step_s"],
        "baseline_median_step_s": b["median_step_s"],
        "ratio": a["median_step_s"] / b["median_step_s"],
        "ratio_p10": a["p10_step_s"] / b["p10_step_s"],
        "per_round": per_round,
        "ci95": round_interval(a, b, lambda x, y: x / y),
        **weights(None),
    }


def weights(diff: float | None, finite: bool = True) -> Row:
    return {
        "max_abs_weight_diff": diff,
        "weights_equal": diff == 0.0,
        "weights_passed": diff is not None and finite and diff <= WEIGHT_ATOL,
    }


def overheads(rows: list[Row], jobs: Sequence[Job] = (), work: Path | None = None) -> list[Row]:
    """Every pair of :data:`~benchmarks.plan.PAIRS` measured in separate
    launches, with the final weights of their first rounds compared when
    ``work`` holds them."""
    first = {(j.impl, j.nproc): j for j in jobs if j.repeat == 0 and not j.error}
    out = []
    for a, b in PAIRS:
        for row in rows:
            ref = next(
                (r for r in rows if r["impl"] == b and r["nproc"] == row["nproc"] and r["case_id"] == row["case_id"]),
                None,
            )
            if row["impl"] != a or ref is None:
                continue
            entry = compare(row, ref, impl=a, baseline=b, how="launches", case_id=row["case_id"], nproc=row["nproc"])
            ja, jb = first.get((a, row["nproc"])), first.get((b, row["nproc"]))
            if work is not None and ja and jb:
                case = next(c for c in ja.cases if c.id == row["case_id"])
                entry.update(weight_diff(weights_path(ja.out(work), a, case), weights_path(jb.out(work), b, case)))
            out.append(entry)
    return out


def weight_diff(fa: Path, fb: Path) -> Row:
    """Max absolute difference between two saved state dicts (inf when their keys or shapes differ)."""
    import torch

    if not (fa.is_file() and fb.is_file()):
        return weights(None)
    wa = torch.load(fa, map_location="cpu", weights_only=True)
    wb = torch.load(fb, map_location="cpu", weights_only=True)
    if wa.keys() != wb.keys() or any(wa[k].shape != wb[k].shape for k in wa):
        return weights(float("inf"))
    diff = max((float((wa[k].float() - wb[k].float()).abs().max()) for k in wa if wa[k].numel()), default=0.0)
    return weights(diff, all(bool(torch.isfinite(v).all()) for v in wa.values() if v.is_floating_point()))


def same_process(reports: list[dict[str, Any]]) -> Row:
    """One same-process launch (``benchmarks.same_process``, every rank's
    report): parallelx against the plain step over the alternating blocks,
    block i of each implementation forming a round, and the two models'
    final weights."""
    rows = {}
    for name in ("plain", "parallelx"):
        blocks = [lockstep(per_rank) for per_rank in zip(*(rep["blocks"][name] for rep in reports))]
        rows[name] = timing(list(range(len(blocks))), blocks)
    family = reports[0]["impl"].removeprefix("same-")
    entry = compare(
        rows["parallelx"],
        rows["plain"],
        impl=f"px-{family}",
        baseline=f"raw-{family}",
        how="same process",
        case_id=reports[0]["case_id"],
        nproc=len(reports),
    )
    entry["steps_per_round"] = len(rows["plain"]["round_step_times_s"][0])
    return {**entry, **weights(max(rep["max_abs_weight_diff"] for rep in reports))}


def same_process_jobs(jobs: list[Job], work: Path) -> list[Row]:
    out = []
    for job in jobs:
        if IMPLS[job.impl].paired and not job.error:
            out += [same_process(reps) for case in job.cases if len(reps := rank_reports(job, work, case)) == job.nproc]
    return out


def scaling(rows: list[Row]) -> list[Row]:
    """images/s with N processes over images/s with 1, for every
    implementation that has 1-process runs of the same work: against one
    process using all the cores' threads, and against one process with the
    threads each of the N processes has."""
    out = []
    for row in rows:
        if row["nproc"] == 1:
            continue
        ones = [r for r in rows if r["impl"] == row["impl"] and r["nproc"] == 1 and r["base_id"] == row["base_id"]]
        entry = {
            "impl": row["impl"],
            "case_id": row["base_id"],
            "model": row["model"],
            "batch": row["batch"],
            "nproc": row["nproc"],
            "threads_n": row["threads"],
            "images_per_s_n": row["images_per_s"],
        }
        for key, one in (
            ("all_cores", next((r for r in ones if r["case_id"] == r["base_id"]), None)),
            ("same_threads", next((r for r in ones if r["threads"] == row["threads"]), None)),
        ):
            if one is not None:
                speedup = row["images_per_s"] / one["images_per_s"]
                # speedup = (n * batch / step_n) / (batch / step_1)
                ci = round_interval(row, one, lambda step_n, step_1, n=row["nproc"]: n * step_1 / step_n)
                entry[key] = {
                    "threads_1": one["threads"],
                    "images_per_s_1": one["images_per_s"],
                    "speedup": speedup,
                    "efficiency": speedup / row["nproc"],
                    "ci95": ci,
                }
        if "all_cores" in entry or "same_threads" in entry:
            out.append(entry)
    return out
