"""Write a benchmark result (built by ``benchmarks.run``) as JSON, a Markdown
table and a PNG chart.

    python -m benchmarks.report benchmarks/results/results.json   # re-render .md and .png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

LABELS = {"raw-ddp": "DDP (plain)", "px-ddp": "DDP (parallelx)", "raw-horovod": "Horovod (plain)",
          "px-horovod": "Horovod (parallelx)", "raw-deepspeed": "DeepSpeed (plain)",
          "px-deepspeed": "DeepSpeed (parallelx)", "accelerate": "Accelerate", "ctl-ddp": "DDP (plain, again)",
          "ctl-horovod": "Horovod (plain, again)", "ctl-deepspeed": "DeepSpeed (plain, again)"}


def write_all(result: dict[str, Any], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.json", out_dir / "results.md", out_dir / "results.png"]
    paths[0].write_text(json.dumps(result, indent=1) + "\n")
    paths[1].write_text(markdown(result))
    chart(result, paths[2])
    return paths


def _ms(s: float) -> str:
    return f"{s * 1000:.1f}" if s < 10 else f"{s * 1000:.0f}"


def _fmt(x: float | None, nd: int | None = None) -> str:
    if x is None:
        return "-"
    if nd is None:  # enough digits for small numbers (VGG16 on a CPU: a few images/s)
        nd = 2 if abs(x) < 10 else 1 if abs(x) < 100 else 0
    return f"{x:,.{nd}f}"


def _x(entry: dict[str, Any] | None, bold: bool = False) -> str:
    if entry is None:
        return "-"
    text = f"{entry['speedup']:.2f}x"
    return (f"**{text}**" if bold else text) + _ci(entry.get("ci95"), "{:.2f}")


def _ci(interval: list[float] | None, fmt: str = "{:.3f}") -> str:
    """A 95 % interval as ' [lo, hi]' (results from before intervals existed have none)."""
    return "" if not interval else " [" + ", ".join(fmt.format(v) for v in interval) + "]"


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    hw, v, m = meta["hardware"], meta["versions"], meta["machine"]
    gpus = ", ".join(hw["gpus"]) if hw["gpus"] else "no GPU"
    lines = [
        f"# Benchmark results ({meta['mode']} mode)",
        "",
        f"- Command: `{meta['command']}` (started {meta['started']}, {meta['wall_s']:.0f} s wall)",
        f"- Hardware: {hw['arch']}, {hw['cpu']}, {hw['cores']} cores, {hw['memory_gib']} GiB, {gpus}",
        f"- Software: Python {v['python']}, torch {v['torch']}, torchvision {v['torchvision']}, "
        f"deepspeed {v['deepspeed']}, horovod {v['horovod']}, accelerate {v['accelerate']}",
        f"- Processes: {m['nproc']} per run ({m['comm']}), {m['threads_n']} torch thread(s) each "
        f"(OMP_NUM_THREADS={m['threads_n']}); 1-process runs use {m['threads_1']} thread(s); "
        + ("each process pinned to its own core(s), local rank r with t threads on the r-th block of t cores, "
           "the same for every implementation" if m.get("bind_cores") else "processes not pinned to cores"),
        f"- Load average at start / end: {meta['load_average_start'][0]:.2f} / {meta['load_average_end'][0]:.2f}",
        f"- Warm-up steps excluded; step times pooled over {meta['preset']['repeats']} alternating round(s) of "
        f"plain/parallelx launches"
        + (f" (VGG16 in the first {min(meta['preset']['vgg_repeats'], meta['preset']['repeats'])})"
           if "vgg16" in meta["models"] else ""),
        "",
    ]
    if meta["skipped"]:
        lines += ["Skipped: " + "; ".join(f"{k} ({v})" for k, v in meta["skipped"].items()), ""]

    lines += ["## Overhead: parallelx / plain script, same launch settings", "",
              f"ratio = median step time of parallelx / of the plain script (target <= {meta['ratio_target']}; "
              "rows 'plain, again' divide a second run of the plain script by the first: no difference exists "
              "there, so they show what noise alone does to the ratio), "
              "with its 95 % bootstrap interval over the rounds in brackets; per round: the same for each "
              "alternation alone, which shows the machine's noise; p10: the ratio of the 10th-percentile step "
              "times, which that noise disturbs less. Final weights compared after warm-up + timed steps "
              f"(pass: max |diff| <= {meta['weight_tolerance']:g}).",
              "",
              "| backend | case | procs | parallelx ms | plain ms | ratio [95 % interval] | per round | p10 ratio "
              "| final weights |",
              "|---|---|---:|---:|---:|---:|---|---:|---|"]
    weights = {(w["impl"], w["case_id"], w["nproc"]): w for w in result["weights"]}
    for o in result["overhead"]:
        w = weights.get((o["impl"], o["case_id"], o["nproc"]))
        wtxt = "-" if w is None else (("identical (0)" if w["identical"] else f"{w['max_abs_diff']:.2g}")
                                      + ("" if w["passed"] else " **FAIL**"))
        name = LABELS.get(o["impl"], o["impl"]) + ("" if o["impl"].startswith("px-")
                                                   else f" vs {LABELS.get(o['baseline'], o['baseline'])}")
        lines.append(f"| {name} | {o['case_id']} | {o['nproc']} | {_ms(o['median_step_s'])} | "
                     f"{_ms(o['baseline_median_step_s'])} | **{o['ratio']:.3f}**{_ci(o.get('ci95'))} | "
                     f"{', '.join(f'{r:.3f}' for r in o['repeat_ratios'])} | {o['ratio_p10']:.3f} | {wtxt} |")
    lines.append("")

    if result.get("same_process"):
        lines += ["## Overhead in the same processes: the plain step and parallelx's, alternating", "",
                  "One launch per backend builds both the plain script's training step and parallelx's on two "
                  "copies of the model and alternates blocks of timed steps between them (plain, parallelx; "
                  "parallelx, plain; ...), so that launch-to-launch noise drops out. ratio = median step time of "
                  "parallelx / of the plain step over all blocks, 95 % bootstrap interval over the blocks in "
                  "brackets; final weights: the two models after the same batches.", "",
                  "| backend | case | procs | blocks x steps | parallelx ms | plain ms | ratio [95 % interval] "
                  "| blocks with parallelx faster | final weights |",
                  "|---|---|---:|---|---:|---:|---:|---:|---|"]
        for o in result["same_process"]:
            faster = sum(r < 1 for r in o["block_ratios"])
            wtxt = ("identical (0)" if o["max_abs_weight_diff"] == 0 else f"{o['max_abs_weight_diff']:.2g}") + (
                "" if o["weights_passed"] else " **FAIL**")
            backend = LABELS.get("px-" + o["family"], o["family"]).split(" (")[0]
            lines.append(f"| {backend} | {o['case_id']} | {o['nproc']} | "
                         f"{o['blocks']} x {o['steps_per_block']} | {_ms(o['median_step_s'])} | "
                         f"{_ms(o['baseline_median_step_s'])} | **{o['ratio']:.3f}**{_ci(o.get('ci95'))} | "
                         f"{faster} of {len(o['block_ratios'])} | {wtxt} |")
        lines.append("")

    lines += ["## Throughput", "",
              "images/s = processes x batch / median step time; epoch = projected full-dataset epoch "
              "(CIFAR-10 50,000 images, Dogs-vs-Cats 20,000) at that rate; memory = peak RSS of the largest process "
              "(it includes the Python, torch and framework runtime).", "",
              "| implementation | case | procs x threads | median step ms | images/s | epoch s | peak RSS MiB |",
              "|---|---|---|---:|---:|---:|---:|"]
    for r in result["runs"]:
        lines.append(f"| {LABELS.get(r['impl'], r['impl'])} | {r['case_id']} | {r['nproc']} x {r['threads']} | "
                     f"{_ms(r['median_step_s'])} | {_fmt(r['images_per_s'])} | {_fmt(r['epoch_s_projected'])} | "
                     f"{_fmt(r['peak_rss_mib'])} |")
    lines.append("")

    if result["scaling"]:
        n = m["nproc"]
        lines += [f"## Scaling: {n} processes against 1 on the same machine", "",
                  f"speedup = images/s of {n} processes ({m['threads_n']} thread(s) each) / images/s of 1 process, "
                  f"which gets either all {m['threads_1']} threads (same hardware) or {m['threads_n']} "
                  f"(same resources per process, pure data-parallel scaling); efficiency = speedup / {n}; "
                  "95 % bootstrap interval over the rounds in brackets.", "",
                  f"| implementation | case | {n} procs images/s | 1 proc x {m['threads_1']} thr images/s | speedup "
                  f"| 1 proc x {m['threads_n']} thr images/s | speedup | efficiency |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for sc in sorted(result["scaling"], key=lambda x: (x["model"] != "lenet", x["batch"], x["impl"])):
            cores, same = sc.get("all_cores"), sc.get("same_threads")
            lines.append(f"| {LABELS.get(sc['impl'], sc['impl'])} | {sc['case_id']} | {_fmt(sc['images_per_s_n'])} | "
                         f"{_fmt(cores and cores['images_per_s_1'])} | {_x(cores)} | "
                         f"{_fmt(same and same['images_per_s_1'])} | {_x(same, bold=True)} | "
                         f"{'-' if same is None else format(same['efficiency'], '.0%')} |")
        lines.append("")

    loader = result.get("loader")
    if loader:
        lines += ["## Dogs-vs-Cats input pipeline against the model", ""]
        if "error" in loader:
            lines += [f"Not measured: {loader['error']}", ""]
        else:
            src = "generated JPEGs (64-320 px)" if loader["generated"] else loader["data_dir"]
            lines += [f"DataLoader over {loader['images']} {src}, decoded and resized to {loader['image_size']} px, "
                      f"batch 16, in a process with {loader['threads']} thread(s).", "",
                      "| loader workers | images/s |", "|---:|---:|"]
            lines += [f"| {r['workers']} | {_fmt(r['images_per_s'])} |" for r in loader["results"]]
            if loader.get("model"):
                lines += ["", "| model consumer | images/s (all procs) | images/s per process |", "|---|---:|---:|"]
                lines += [f"| {LABELS.get(x['impl'], x['impl'])}, VGG16 {loader['image_size']} px | "
                          f"{_fmt(x['images_per_s'])} | {_fmt(x['images_per_s_per_process'])} |"
                          for x in loader["model"]]
                verdict = "**is not** the bottleneck" if not loader["bottleneck"] else "**is** the bottleneck"
                lines += ["", f"One loader worker delivers {loader['loader_over_model']:,.0f}x what one training "
                              f"process consumes: loading {verdict}."]
            lines.append("")

    if result["failures"]:
        lines += ["## Failures", ""]
        for f in result["failures"]:
            first = f["error"].splitlines()[0] if f["error"] else ""
            lines.append(f"- `{f['job']}`: {first}")
        lines.append("")
    return "\n".join(lines)


def chart(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result["runs"] if r["nproc"] == result["meta"]["machine"]["nproc"]]
    cases = []
    for r in runs:
        main_lenet = r["batch"] == result["meta"]["preset"]["lenet_batch"]
        if r["case_id"] not in cases and (r["model"] == "vgg16" or main_lenet):
            cases.append(r["case_id"])
    same = result.get("same_process") or []  # absent from results written before that part existed
    panels = len(cases) + (1 if result["scaling"] else 0) + (1 if result["overhead"] or same else 0)
    cols = 2 if panels > 1 else 1
    rows_n = -(-max(1, panels) // cols)
    fig, grid = plt.subplots(rows_n, cols, figsize=(6.4 * cols, 4.4 * rows_n), squeeze=False)
    axes = [ax for row in grid for ax in row]
    for ax in axes[panels:]:
        ax.set_visible(False)
    colors = {"raw": "#8c8c8c", "px-": "#1f77b4", "acc": "#ff7f0e", "ctl": "#c7c7c7"}
    for ax, case in zip(axes, cases):
        rows = [r for r in runs if r["case_id"] == case]
        names = [LABELS.get(r["impl"], r["impl"]).replace(" (", "\n(") for r in rows]
        ax.bar(names, [r["images_per_s"] for r in rows], color=[colors[r["impl"][:3]] for r in rows])
        ax.set_title(f"{case}, {rows[0]['nproc']} processes")
        ax.set_ylabel("images/s (higher is better)")
        ax.tick_params(axis="x", labelsize=7)
    rest = axes[len(cases):]
    if (result["overhead"] or same) and rest:
        ax = rest.pop(0)
        n = result["meta"]["machine"]["nproc"]
        ov = [o for o in result["overhead"] if o["impl"][:3] in ("px-", "ctl") and o["nproc"] == n]
        ov.sort(key=lambda o: (o["impl"].split("-", 1)[1], o["case_id"], o["impl"].startswith("ctl")))
        # (label, ratio, 95 % interval, single rounds or blocks, colour) per bar.
        bars = [(f"{o['impl'].split('-', 1)[1]}{' again' if o['impl'].startswith('ctl') else ''}\n"
                 f"{o['case_id'].replace('-32px', '')}", o["ratio"], o.get("ci95"), o["repeat_ratios"],
                 colors[o["impl"][:3]]) for o in ov]
        bars += [(f"{o['family']} same\nprocess", o["ratio"], o.get("ci95"), o["block_ratios"], colors["px-"])
                 for o in same if o["nproc"] == n]
        ratios = [b[1] for b in bars]
        ax.bar([b[0] for b in bars], ratios, color=[b[4] for b in bars])
        # 95 % intervals, where the run had enough rounds for one.
        with_ci = [i for i, b in enumerate(bars) if b[2]]
        for i in with_ci:
            ax.plot([i, i], bars[i][2], color="#d62728", lw=2, label="95 % interval" if i == with_ci[0] else None)
            ratios += bars[i][2]
        # Each round's (or block's) own ratio: the spread is the machine's noise.
        for i, b in enumerate(bars):
            ax.plot([i] * len(b[3]), b[3], "k.", ms=4, label="single rounds / blocks" if i == 0 else None)
        ratios += [r for b in bars for r in b[3]]
        ax.axhline(1.0, color="black", lw=0.8)
        ax.axhline(result["meta"]["ratio_target"], color="red", ls="--", lw=0.8, label="target")
        ax.set_ylim(min([0.9, *ratios]) - 0.02, max([1.1, *ratios]) + 0.02)
        ax.set_title(f"median step time parallelx (or plain again) / plain, {n} processes", fontsize=9)
        ax.tick_params(axis="x", labelsize=7, rotation=45)
        ax.legend(fontsize=7)
    if result["scaling"] and rest:
        ax = rest.pop(0)
        m = result["meta"]["machine"]
        palette = {"raw-ddp": "#555555", "px-ddp": colors["px-"]}
        for impl in dict.fromkeys(x["impl"] for x in result["scaling"]):
            for key, style, what in (("same_threads", "-", f"1 proc x {m['threads_n']} thr"),
                                     ("all_cores", "--", f"1 proc x {m['threads_1']} thr")):
                pts = sorted((x["batch"], x[key]["speedup"]) for x in result["scaling"]
                             if x["impl"] == impl and x["model"] == "lenet" and key in x)
                if pts:
                    ax.plot([q[0] for q in pts], [q[1] for q in pts], style, marker="o", color=palette.get(impl),
                            label=f"{LABELS.get(impl, impl)} vs {what}")
        n = result["meta"]["machine"]["nproc"]
        ax.axhline(n, color="black", lw=0.8, ls=":", label=f"ideal ({n}x)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("LeNet images per process per step")
        ax.set_ylabel(f"speedup, {n} processes vs 1")
        ax.set_title("LeNet scaling")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7, handlelength=3.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m benchmarks.report RESULTS.json", file=sys.stderr)
        return 2
    src = Path(args[0])
    result = json.loads(src.read_text())
    src.with_suffix(".md").write_text(markdown(result))
    chart(result, src.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
