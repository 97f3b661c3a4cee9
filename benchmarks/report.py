"""A benchmark result (built by ``benchmarks.run``) as the files that are
kept: ``results.md`` (the tables) and ``summary.json`` (a few dozen lines: per
comparison the ratio, its interval, the rounds, whether the final weights are
identical, and the environment).  Every step time goes only to the raw JSON,
which is not committed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.plan import IMPLS


def write(result: dict[str, Any], out_dir: Path, raw: Path, markdown_text: str, summary_obj: dict[str, Any]) -> None:
    """``results.md`` and ``summary.json`` in ``out_dir``, and the whole result (every step time) at ``raw``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.md").write_text(markdown_text)
    (out_dir / "summary.json").write_text(compact_json(summary_obj))
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text(json.dumps(result, indent=1) + "\n")


def _label(impl: str) -> str:
    return IMPLS[impl].label if impl in IMPLS else impl


def _ms(s: float) -> str:
    return f"{s * 1000:.1f}" if s < 10 else f"{s * 1000:.0f}"


def _fmt(x: float | None, digits: int | None = None) -> str:
    if x is None:
        return "-"
    if digits is None:  # enough digits for small numbers (VGG16 on a CPU: a few images/s)
        digits = 2 if abs(x) < 10 else 1 if abs(x) < 100 else 0
    return f"{x:,.{digits}f}"


def ci(interval: list[float] | None, fmt: str = "{:.3f}") -> str:
    return "" if not interval else " [" + ", ".join(fmt.format(v) for v in interval) + "]"


def _x(entry: dict[str, Any] | None, bold: bool = False) -> str:
    if entry is None:
        return "-"
    text = f"{entry['speedup']:.2f}x"
    return (f"**{text}**" if bold else text) + ci(entry.get("ci95"), "{:.2f}")


def _weights(c: dict[str, Any]) -> str:
    diff = c["max_abs_weight_diff"]
    if diff is None:
        return "-"
    return ("identical" if c["weights_equal"] else f"{diff:.2g}") + ("" if c["weights_passed"] else " **FAIL**")


def header(meta: dict[str, Any]) -> list[str]:
    """The lines every report starts with: how it was run, on what, and how busy the machine was."""
    hw = meta["hardware"]
    return [
        f"- Command: `{meta['command']}` (started {meta['started']}, {meta['wall_s']:.0f} s wall)",
        f"- Hardware: {hw['arch']}, {hw['cpu']}, {hw['cores']} cores, {hw['memory_gib']} GiB, "
        f"{', '.join(hw['gpus']) or 'no GPU'}",
        "- Software: " + ", ".join(f"{k} {val}" for k, val in meta["versions"].items() if k != "parallelx"),
        f"- Load average at start / end: {meta['load_average_start'][0]:.2f} / {meta['load_average_end'][0]:.2f} "
        "(other jobs on the machine add to the spread)",
    ]


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    m, p = meta["machine"], meta["preset"]
    pinned = (
        "each process pinned to its own core(s), the same for every implementation"
        if m.get("bind_cores")
        else "processes not pinned to cores"
    )
    lines = [
        f"# Benchmark results ({meta['mode']} mode)",
        "",
        *header(meta),
        f"- Processes: {m['nproc']} per run ({m['comm']}), {m['threads_n']} torch thread(s) each; 1-process runs "
        f"use {m['threads_1']}; {pinned}",
        f"- Warm-up steps excluded; {p['repeats']} round(s) of alternating launches"
        + (f" (VGG16 in the first {min(p['vgg_repeats'], p['repeats'])})" if "vgg16" in meta["models"] else ""),
        "",
    ]
    if meta["skipped"]:
        lines += ["Skipped: " + "; ".join(f"{k} ({why})" for k, why in meta["skipped"].items()), ""]

    if result["comparisons"]:
        lines += [
            "## Overhead: median step time, measured / baseline",
            "",
            f"Target <= {meta['ratio_target']} for parallelx. 'launches': separate launches, rounds "
            "alternating; 'same process': one launch alternating blocks of both steps on two copies of the "
            "model. '(plain, again)' rows repeat the plain script: their spread is the noise. 95 % bootstrap "
            "interval over the rounds (blocks) in brackets; p10: ratio of the 10th-percentile step times; "
            f"final weights: max |diff| after the same steps (pass: <= {meta['weight_tolerance']:g}).",
            "",
            "| measured / baseline | how | case | procs | ms | baseline ms | ratio [95 % interval] "
            "| rounds below 1, range | p10 ratio | final weights |",
            "|---|---|---|---:|---:|---:|---:|---|---:|---|",
        ]
        for c in result["comparisons"]:
            rounds = c["per_round"]
            how = c["how"] + (f", {c['steps_per_round']} steps a block" if "steps_per_round" in c else "")
            lines.append(
                f"| {_label(c['impl'])} / {_label(c['baseline'])} | {how} | {c['case_id']} | {c['nproc']} | "
                f"{_ms(c['median_step_s'])} | {_ms(c['baseline_median_step_s'])} | "
                f"**{c['ratio']:.3f}**{ci(c['ci95'])} | {sum(r < 1 for r in rounds)} of {len(rounds)}, "
                f"{min(rounds):.3f}-{max(rounds):.3f} | {_fmt(c['ratio_p10'], 3)} | {_weights(c)} |"
            )
        lines.append("")

    if result["runs"]:
        lines += [
            "## Throughput",
            "",
            "images/s = processes x batch / median step time; epoch s: one epoch of the real dataset "
            "(CIFAR-10 50,000 images, Dogs-vs-Cats 20,000) at that rate; peak RSS of the largest process "
            "(Python, torch and the framework included).",
            "",
            "| implementation | case | procs x threads | median step ms | images/s | epoch s | peak RSS MiB |",
            "|---|---|---|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {_label(r['impl'])} | {r['case_id']} | {r['nproc']} x {r['threads']} | {_ms(r['median_step_s'])} "
            f"| {_fmt(r['images_per_s'])} | {_fmt(r['epoch_s_projected'])} | {_fmt(r['peak_rss_mib'])} |"
            for r in result["runs"]
        ]
        lines.append("")

    if result["scaling"]:
        n, t1, tn = m["nproc"], m["threads_1"], m["threads_n"]
        lines += [
            f"## Scaling: {n} processes against 1",
            "",
            f"speedup = images/s of {n} processes ({tn} thread(s) each) / images/s of 1 process with all "
            f"{t1} threads (same hardware) or with {tn} (same resources per process); efficiency = speedup "
            f"/ {n}; 95 % bootstrap interval over the rounds in brackets.",
            "",
            f"| implementation | case | {n} procs images/s | 1 x {t1} thr images/s | speedup "
            f"| 1 x {tn} thr images/s | speedup | efficiency |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for sc in sorted(result["scaling"], key=lambda x: (x["model"] != "lenet", x["batch"], x["impl"])):
            cores, same = sc.get("all_cores"), sc.get("same_threads")
            lines.append(
                f"| {_label(sc['impl'])} | {sc['case_id']} | {_fmt(sc['images_per_s_n'])} | "
                f"{_fmt(cores and cores['images_per_s_1'])} | {_x(cores)} | "
                f"{_fmt(same and same['images_per_s_1'])} | {_x(same, bold=True)} | "
                f"{'-' if same is None else format(same['efficiency'], '.0%')} |"
            )
        lines.append("")

    if result["failures"]:
        lines += ["## Failures", ""]
        lines += [f"- `{f['job']}`: {(f['error'] or '').splitlines()[0]}" for f in result["failures"]]
        lines.append("")
    return "\n".join(lines)


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers, without the per-step data."""
    meta, m = result["meta"], result["meta"]["machine"]
    hw = meta["hardware"]
    return {
        "command": meta["command"],
        "started": meta["started"],
        "wall_s": round(meta["wall_s"]),
        "env": {
            "hardware": f"{hw['arch']}, {hw['cpu']}, {hw['cores']} cores, {hw['memory_gib']} GiB, "
            f"{', '.join(hw['gpus']) or 'no GPU'}",
            "versions": meta["versions"],
            "processes": m["nproc"],
            "threads": m["threads_n"],
            "threads_1_process": m["threads_1"],
            "comm": m["comm"],
            "pinned": bool(m.get("bind_cores")),
        },
        "comparisons": [
            {
                "impl": c["impl"],
                "baseline": c["baseline"],
                "how": c["how"],
                "case": c["case_id"],
                "procs": c["nproc"],
                "rounds": len(c["per_round"]),
                "ms": c["median_step_s"] * 1000,
                "baseline_ms": c["baseline_median_step_s"] * 1000,
                "ratio": c["ratio"],
                "ci95": c["ci95"],
                "p10_ratio": c["ratio_p10"],
                "weights_equal": c["weights_equal"] if c["max_abs_weight_diff"] is not None else None,
            }
            for c in result["comparisons"]
        ],
        "scaling": [
            {
                "impl": s["impl"],
                "case": s["case_id"],
                "procs": s["nproc"],
                "images_per_s": s["images_per_s_n"],
                **{f"speedup_{k}": s[k]["speedup"] for k in ("same_threads", "all_cores") if k in s},
                "ci95_same_threads": (s.get("same_threads") or {}).get("ci95"),
            }
            for s in result["scaling"]
        ],
        "failures": [f"{f['job']}: {(f['error'] or '').splitlines()[0]}" for f in result["failures"]],
    }


def rounded(v: Any) -> Any:
    """Every float in ``v`` to 4 significant digits: more than the machine's noise allows to mean anything."""
    if isinstance(v, float):
        return float(f"{v:.4g}")
    if isinstance(v, dict):
        return {k: rounded(x) for k, x in v.items()}
    return [rounded(x) for x in v] if isinstance(v, (list, tuple)) else v


def compact_json(obj: dict[str, Any]) -> str:
    """One line per top-level entry, and per item of a top-level list; floats :func:`rounded`."""

    def value(v: Any) -> str:
        if isinstance(v, list) and v:
            return "[\n  " + ",\n  ".join(json.dumps(x) for x in v) + "\n ]"
        return json.dumps(v)

    return "{\n" + ",\n".join(f" {json.dumps(k)}: {value(v)}" for k, v in rounded(obj).items()) + "\n}\n"
