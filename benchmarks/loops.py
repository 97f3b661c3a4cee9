"""What the training-loop options buy: Dogs-vs-Cats VGG16 through parallelx's
loop, 2 processes with and without ``--accumulate`` and ``--grad-compression``,
against 1 process with all the cores, side by side in one run (benchmarks/README.md).

Each configuration is one launch of ``benchmarks.px_worker --loop`` under its
backend's launcher, with parallelx's own flags; the 1-process runs take the N
processes' global micro-batch, so that images/s compare directly.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

import parallelx
from benchmarks import launch, plan, report, stats
from benchmarks.run import ROOT, Session, add_common
from benchmarks.workload import BenchError, Case
from parallelx.cli import exit_on_error, positive_int

CONFIGS = {c.name: c for c in plan.LOOPS}
BASELINE, PLAIN = "single", "ddp"
#: Untimed micro-batches first, as one short window (it ends in a full all-reduce and optimizer step).
WARMUP = 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.loops",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--only", default=",".join(CONFIGS), help="comma-separated configurations (default: %(default)s)")
    p.add_argument(
        "--image-size",
        type=int,
        default=64,
        help="VGG16 image size (default 64: the recipe's CPU setting; 224 on GPUs)",
    )
    p.add_argument("--batch", type=positive_int, default=16, help="micro-batch per process (default 16)")
    p.add_argument(
        "--steps",
        type=positive_int,
        default=plan.LOOP_ACCUMULATE,
        help=f"timed micro-batches per launch, a multiple of {plan.LOOP_ACCUMULATE} (default: one window)",
    )
    p.add_argument("--repeats", type=positive_int, default=6, help="rounds of rotating launches (default 6)")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="32 px, batch 2, 1 round: checks that everything runs; its numbers mean nothing",
    )
    add_common(
        p, out_dir=ROOT / "benchmarks" / "results" / "loops", raw=ROOT / "runs" / "bench" / "loops.json", timeout=900
    )
    args = p.parse_args(argv)
    args.configs = [x for x in args.only.split(",") if x]
    if bad := [x for x in args.configs if x not in CONFIGS]:
        p.error(f"--only: unknown {', '.join(bad)}; choose from {', '.join(CONFIGS)}")
    if BASELINE not in args.configs:
        p.error(f"--only must include {BASELINE}: every ratio is to it")
    if args.smoke:
        args.image_size, args.batch, args.steps, args.repeats = 32, 2, plan.LOOP_ACCUMULATE, 1
    if args.steps % plan.LOOP_ACCUMULATE:
        p.error(f"--steps must be a multiple of {plan.LOOP_ACCUMULATE} (whole accumulation windows), got {args.steps}")
    return args


def schedule(args: argparse.Namespace, machine: plan.Machine, configs: list[str]) -> list[plan.Job]:
    """Every launch, in order: each round runs every configuration once, the order rotated by one each round."""
    jobs = []
    for r in range(args.repeats):
        for name in configs[r % len(configs) :] + configs[: r % len(configs)]:
            # A backend whose launcher starts one process (single) gets all the cores and the global micro-batch.
            one = not parallelx.describe(CONFIGS[name].backend).launcher.multi_process
            case = Case(
                model="vgg16",
                batch=args.batch * (machine.nproc if one else 1),
                image_size=args.image_size,
                warmup=WARMUP,
                steps=args.steps,
                lr=0.001,
            )
            jobs.append(
                plan.Job(
                    impl=f"loop-{name}",
                    nproc=1 if one else machine.nproc,
                    cases=[case],
                    repeat=r,
                    threads=machine.threads_1 if one else machine.threads_n,
                )
            )
    return jobs


def versus(row: stats.Row, ref: stats.Row | None) -> dict[str, Any] | None:
    """images/s of ``row`` over those of ``ref``, with the 95 % interval over rounds."""
    if ref is None or ref is row:
        return None
    ia, ib = row["nproc"] * row["batch"], ref["nproc"] * ref["batch"]
    return {
        "ratio": row["images_per_s"] / ref["images_per_s"],
        "ci95": stats.round_interval(row, ref, lambda ta, tb: (ia / ta) / (ib / tb)),
    }


def summarise(rows: list[stats.Row]) -> list[dict[str, Any]]:
    by = {r["impl"].removeprefix("loop-"): r for r in rows}
    out = []
    for name, config in CONFIGS.items():
        if (row := by.get(name)) is None:
            continue
        per_round = [row["nproc"] * row["batch"] / statistics.median(t) for t in row["round_step_times_s"]]
        opts = config.options
        out.append(
            {
                "config": name,
                "label": config.label,
                "backend": config.backend,
                "options": " ".join(opts),
                "procs": row["nproc"],
                "threads": row["threads"],
                "micro_batch": row["batch"],
                "accumulate": int(opts[opts.index("--accumulate") + 1]) if "--accumulate" in opts else 1,
                "rounds": len(per_round),
                "ms_per_micro_batch": row["median_step_s"] * 1000,
                "images_per_s": row["images_per_s"],
                "images_per_s_rounds": [min(per_round), max(per_round)],
                "vs_single": versus(row, by.get(BASELINE)),
                "vs_ddp": versus(row, by.get(PLAIN)) if row["nproc"] > 1 and name != PLAIN else None,
                "peak_rss_mib": row["peak_rss_mib"],
                "buys": config.buys,
            }
        )
    return out


def _ratio(v: dict[str, Any] | None, bold: bool = False) -> str:
    if v is None:
        return "-"
    return (f"**{v['ratio']:.2f}x**" if bold else f"{v['ratio']:.2f}x") + report.ci(v["ci95"], "{:.2f}")


def markdown(result: dict[str, Any]) -> str:
    meta, m = result["meta"], result["meta"]["machine"]
    lines = [
        "# Training-loop options: Dogs-vs-Cats VGG16, 2 processes against 1",
        "",
        *report.header(meta),
        f"- Workload: VGG16 (138 M parameters, 553 MB of float32 gradients), {meta['image_size']} px, "
        f"{meta['batch']} images per process per micro-batch ({m['nproc']} processes x {m['threads_n']} thread(s), "
        f"{m['comm']}); 1 process x {m['threads_1']} threads takes the same global micro-batch "
        f"({meta['batch'] * m['nproc']} images). SGD with momentum, synthetic batches kept in memory.",
        f"- Each launch: {meta['warmup']} untimed micro-batch(es), then {meta['steps']} timed micro-batches "
        f"through `backend.batches` / `backend.step`; {meta['repeats']} round(s), the launch order rotating "
        f"every round; {'each process pinned to its own cores' if m['bind_cores'] else 'processes not pinned'}",
        "",
        "images/s = the global batch of all processes / median time per micro-batch (an accumulation window's "
        "time divided by its micro-batches), pooled over the rounds; range: lowest and highest single round. "
        "Ratios carry a 95 % bootstrap interval over the rounds (none with fewer than 3).",
        "",
        "| configuration | procs x threads | ms / micro-batch | images/s | range over rounds | "
        "vs 1 process [95 %] | vs plain DDP [95 %] | what the option buys |",
        "|---|---|---:|---:|---|---:|---:|---|",
    ]
    for t in result["table"]:
        lo, hi = t["images_per_s_rounds"]
        opts = f" (`{t['options']}`)" if t["options"] else ""
        vs_single = "baseline" if t["config"] == BASELINE else _ratio(t["vs_single"], bold=t["procs"] > 1)
        lines.append(
            f"| {t['label']}{opts} | {t['procs']} x {t['threads']} | {t['ms_per_micro_batch']:,.0f} | "
            f"**{t['images_per_s']:.2f}** | {lo:.2f}-{hi:.2f} | {vs_single} | {_ratio(t['vs_ddp'])} | "
            f"{t['buys']} |"
        )
    if result["failures"]:
        lines += ["", "Failed launches: " + "; ".join(f["job"] for f in result["failures"])]
    return "\n".join(
        [
            *lines,
            "",
            "Launches (s): "
            + ", ".join(f"{x['job']} {x['seconds']}" + ("" if x["ok"] else " FAILED") for x in meta["launches"]),
            "",
        ]
    )


def summary(result: dict[str, Any]) -> dict[str, Any]:
    meta, m = result["meta"], result["meta"]["machine"]
    keep = (
        "command",
        "started",
        "wall_s",
        "image_size",
        "batch",
        "warmup",
        "steps",
        "repeats",
        "load_average_start",
        "load_average_end",
    )
    env = {
        "hardware": meta["hardware"],
        "versions": meta["versions"],
        "processes": m["nproc"],
        "threads": [m["threads_n"], m["threads_1"]],
        "bind_cores": m["bind_cores"],
    }
    table = [{k: v for k, v in t.items() if k not in ("buys", "label")} for t in result["table"]]
    return {"meta": {k: meta[k] for k in keep}, "env": env, "table": table, "failures": result["failures"]}


@exit_on_error
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    session = Session(args, argv, "benchmarks.loops", "loops")
    machine = session.machine
    if machine.nproc < 2:
        raise BenchError("the loop comparison needs 2 or more processes; use --nproc 2")
    skipped = {n: why for n in args.configs if (why := launch.unavailable(CONFIGS[n].backend))}
    configs = session.drop_skipped(args.configs, skipped)
    print(
        f"[loops] VGG16 {args.image_size} px, batch {args.batch} per process; {machine.nproc} processes x "
        f"{machine.threads_n} thread(s) against 1 x {machine.threads_1}; {args.repeats} round(s) of "
        f"{', '.join(configs)}; work dir {session.work}",
        flush=True,
    )
    jobs = schedule(args, machine, configs)
    for job in jobs:
        launch.run_job(job, machine, session.work, args.timeout)
        print(f"[loops] load average {os.getloadavg()[0]:.2f}", flush=True)
    rows = stats.collect(jobs, session.work)
    failures = [{"job": j.tag, "error": j.error} for j in jobs if j.error]
    meta = session.finish(
        jobs,
        failures,
        image_size=args.image_size,
        batch=args.batch,
        warmup=WARMUP,
        steps=args.steps,
        repeats=args.repeats,
        configs=configs,
        skipped=skipped,
    )
    result = {"meta": meta, "runs": rows, "table": summarise(rows), "failures": failures}
    report.write(result, args.out_dir, args.raw, markdown(result), summary(result))
    print(markdown(result), flush=True)
    print(f"[loops] done in {meta['wall_s']:.0f}s: {args.out_dir}/results.md, summary.json, {args.raw}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
