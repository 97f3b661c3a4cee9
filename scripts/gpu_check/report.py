"""The GPU check's report: one :class:`Item` per check, and ``report.md``
rendered from the summary."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .settings import SECTIONS

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
#: Sections whose figures the Markdown report shows beside each check.
FIGURE_SECTIONS = ("throughput", "host-sync")


@dataclass
class Item:
    """One check: what ran, how it ended, and why."""

    section: str
    name: str
    status: str
    detail: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    needs: str | None = None  # "cuda" for what only a GPU machine can check
    log: str | None = None  # the end of a failed step's output


def section_status(items: Sequence[Item]) -> str:
    if any(i.status == FAILED for i in items):
        return FAILED
    return PASSED if any(i.status == PASSED for i in items) else SKIPPED


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list) and value and all(isinstance(v, float) for v in value):
        return "[" + ", ".join(f"{v:.4g}" for v in value) + "]"
    return str(value)


def render_markdown(summary: dict[str, Any], items: Sequence[Item], env_text: str) -> str:
    counts = summary["counts"]
    env = summary["environment"]
    where = env.get("gpus") or "CPU only"
    lines = [
        "# parallelx GPU check", "",
        f"**Result: {summary['result'].upper()}**: {counts[PASSED]} passed, {counts[FAILED]} failed, "
        f"{counts[SKIPPED]} skipped, in {summary['seconds']:.0f} s (started {summary['started']}).", "",
        f"Mode: {'CUDA' if summary['mode'] == 'cuda' else 'dry run on the CPU (what needs CUDA is skipped)'}; "
        f"{summary['nproc']} process(es) per multi-process launch; {where}.", "",
        "| section | status | passed | failed | skipped |", "|---|---|---:|---:|---:|",
    ]
    for name, sec in summary["sections"].items():
        n = {s: sum(i["status"] == s for i in sec["items"]) for s in (PASSED, FAILED, SKIPPED)}
        lines.append(f"| {name} | {sec['status']} | {n[PASSED]} | {n[FAILED]} | {n[SKIPPED]} |")
    for name in SECTIONS:
        sec_items = [i for i in items if i.section == name]
        lines += ["", f"## {name}", ""]
        if not sec_items:
            lines.append("Nothing ran in this section.")
            continue
        lines += ["| check | status | s | details |", "|---|---|---:|---|"]
        for i in sec_items:
            # The recipes' figures are in their details already; summary.json has them all.
            figures = ("; ".join(f"{k} {_fmt(v)}" for k, v in i.figures.items() if not isinstance(v, dict))
                       if name in FIGURE_SECTIONS else "")
            detail = " ".join(filter(None, [i.detail, f"({figures})" if figures else ""])).replace("|", "\\|")
            lines.append(f"| {i.name} | {i.status.upper() if i.status == FAILED else i.status} | "
                         f"{i.seconds:.1f} | {detail} |")
        if name == "environment" and env_text:
            lines += ["", "`python -m parallelx env`:", "", "```", env_text.rstrip(), "```"]
        for i in sec_items:
            if i.status == FAILED and i.log:
                lines += ["", f"Output of the failed check *{i.name}* (last lines):", "", "```",
                          _tail(i.log, 40), "```"]
    lines += ["", f"Every launch's whole output: `logs.tar.gz` beside this report when run through "
              f"gpu_check.sh, else `{summary['logs']}`.", "",
              "Environment:", "", "```", json.dumps(env, indent=1, default=str), "```", ""]
    return "\n".join(lines)


def _tail(text: str, n: int) -> str:
    # tqdm redraws with carriage returns: keep the last state of each line.
    rows = [line.rsplit("\r", 1)[-1] for line in text.splitlines()]
    return "\n".join(rows[-n:])
