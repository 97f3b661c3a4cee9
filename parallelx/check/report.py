"""The report of a check: a plain object (for ``parallelx.testing`` and
``--report report.json``) and its text form (what the command prints)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Exit statuses of ``python -m parallelx check``.
SAME, DIFFERS, COULD_NOT_RUN = 0, 1, 2


@dataclass
class Diff:
    """Two sets of tensors compared tensor by tensor (relative L2 difference)."""

    #: The largest relative difference, and the tensor where it is.
    worst: float
    tensor: str | None
    #: That tensor's noise floor and tolerance.
    floor: float | None
    tolerance: float
    #: Tensors beyond their tolerance (empty: within it).
    out: list[str] = field(default_factory=list)
    #: The largest floor over all tensors.
    floor_max: float | None = None

    @property
    def ok(self) -> bool:
        return not self.out


@dataclass
class Row:
    """One run of the report (a backend, DeepSpeed once per ZeRO stage)."""

    label: str
    seconds: float
    steps: int = 0
    #: "same", "differs", or "failed" (it could not be used: ``error`` says why).
    status: str = "same"
    error: str | None = None
    ranks_agree: bool | None = None
    #: The first optimizer step after which the ranks held different weights.
    ranks_differ_at: int | None = None
    grads_vs_reference: Diff | None = None
    grads_vs_baseline: Diff | None = None
    weights_vs_reference: Diff | None = None
    weights_vs_baseline: Diff | None = None
    #: The first optimizer step whose loss or gradient norm left the tolerance, and which.
    first_step_out: int | None = None
    first_step_what: str | None = None


@dataclass
class Finding:
    """A diagnosis: what was observed, the likely cause, the fix in one line."""

    cause: str
    what: str
    fix: str
    runs: list[str] = field(default_factory=list)
    #: True: the runs differ because of it (exit status 1).
    fails: bool = True


@dataclass
class Report:
    """What ``python -m parallelx check`` found; ``exit_code`` is the command's exit status."""

    script: list[str]
    nproc: int
    steps: int
    level: int
    #: Why one process could not be compared (level 1 only), else None.
    level_reason: str | None
    floor_method: str
    floor_grads: float | None
    floor_weights: float | None
    min_tolerance: float
    factor: float
    baseline: str | None
    reference: Row | None
    rows: list[Row]
    findings: list[Finding]
    notes: list[str]
    exit_code: int
    verdict: str
    seconds: float
    #: ``--tensor-parallel``'s degree: each of the ``nproc`` ranks is a group of this many processes.
    tensor_parallel: int = 1

    @property
    def same(self) -> bool:
        return self.exit_code == SAME

    def differences(self) -> list[Finding]:
        return [f for f in self.findings if f.fails]

    def row(self, label: str) -> Row:
        for r in self.rows:
            if r.label == label:
                return r
        raise KeyError(f"no run {label!r} in this report; runs: {', '.join(r.label for r in self.rows)}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n")

    # ---------------------------------------------------------------- text
    def render(self) -> str:
        processes = (
            f"{self.nproc} processes"
            if self.tensor_parallel == 1
            else f"{self.nproc * self.tensor_parallel} processes ({self.nproc} data-parallel x tensor parallel "
            f"{self.tensor_parallel})"
        )
        lines = [f"parallelx check: {' '.join(self.script)}", f"  {processes}, {self.steps} optimizer steps"]
        if self.level == 2:
            lines.append(
                f"  reference: one process playing {self.nproc} rank{'s' if self.nproc != 1 else ''}; it rebuilt every rank's batches exactly, "
                "so each backend is compared with it (level 2) and with the others (level 1)"
            )
        else:
            lines.append(f"  reference: level 1 only (the backends against each other): {self.level_reason}")
        if self.floor_grads is not None:
            lines.append(
                f"  noise floor: {self.floor_method}: gradients at step 1 up to {fmt(self.floor_grads)}, "
                f"weights after {self.steps} steps up to {fmt(self.floor_weights)}"
            )
        else:
            lines.append(f"  noise floor: not measured ({self.floor_method})")
        lines.append(
            f"  tolerance: {self.factor:g} x each tensor's floor, at least {fmt(self.min_tolerance)} (relative, L2)"
        )
        lines.append("")
        lines += self._table()
        failing = self.differences()
        if failing:
            lines += ["", "differences:"]
            for i, f in enumerate(failing, 1):
                lines += [f"  {i}. {f.what}", f"     fix: {f.fix}"]
        notes = [f"{f.what} ({f.fix})" for f in self.findings if not f.fails] + self.notes
        if notes:
            lines += ["", "notes:"]
            lines += [f"  - {n}" for n in notes]
        lines += ["", f"verdict: {self.verdict}"]
        return "\n".join(lines) + "\n"

    def _table(self) -> list[str]:
        base = self.baseline or "-"
        head = [
            "run",
            "time",
            "steps",
            "ranks agree",
            "step-1 grads vs ref (floor)" if self.level == 2 else f"step-1 grads vs {base} (floor)",
            "weights vs ref (floor)",
            f"weights vs {base}",
            "largest at",
            "first step out",
        ]
        rows = []
        if self.reference is not None:
            r = self.reference
            rows.append(
                [
                    "reference",
                    f"{r.seconds:.1f}s",
                    str(r.steps),
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    "-" if r.error is None else "failed",
                ]
            )
        for r in self.rows:
            if r.status == "failed":
                rows.append([r.label, f"{r.seconds:.1f}s", str(r.steps), "failed", "", "", "", "", ""])
                continue
            ranks = "yes" if r.ranks_agree else f"no (step {r.ranks_differ_at})" if r.ranks_agree is False else "-"
            grads = r.grads_vs_reference if self.level == 2 else r.grads_vs_baseline
            weights_ref = r.weights_vs_reference if self.level == 2 else None
            where = (weights_ref or r.weights_vs_baseline or grads) if r.label != self.baseline else weights_ref
            rows.append(
                [
                    r.label,
                    f"{r.seconds:.1f}s",
                    str(r.steps),
                    ranks,
                    with_floor(grads),
                    with_floor(weights_ref),
                    "-" if r.label == self.baseline else with_floor(r.weights_vs_baseline, floor=False),
                    (where.tensor or "-") if where is not None and where.worst > 0 else "-",
                    f"{r.first_step_out} ({r.first_step_what})" if r.first_step_out is not None else "-",
                ]
            )
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)] if rows else []
        out = ["  " + "  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip()]
        for row in rows:
            out.append("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        failed = [r for r in self.rows if r.status == "failed"]
        for r in failed:
            out.append(f"  {r.label} failed: {r.error}")
        if self.reference is not None and self.reference.error is not None:
            out.append(f"  the reference failed: {self.reference.error}")
        return out


def fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0"
    return f"{x:.1e}"


def with_floor(d: Diff | None, floor: bool = True) -> str:
    if d is None:
        return "-"
    text = fmt(d.worst)
    if floor and d.floor is not None:  # beside every figure, 0 included: what "the same" was judged against
        text += f" ({fmt(d.floor)})"
    if not d.ok:
        text += " !"
    return text


def from_dict(data: dict[str, Any]) -> Report:
    """A report read back from :meth:`Report.to_dict` (``--report`` files)."""

    def diff(d: dict[str, Any] | None) -> Diff | None:
        return None if d is None else Diff(**d)

    def row(d: dict[str, Any] | None) -> Row | None:
        if d is None:
            return None
        d = dict(d)
        for k in ("grads_vs_reference", "grads_vs_baseline", "weights_vs_reference", "weights_vs_baseline"):
            d[k] = diff(d[k])
        return Row(**d)

    data = dict(data)
    data["reference"] = row(data["reference"])
    data["rows"] = [row(r) for r in data["rows"]]
    data["findings"] = [Finding(**f) for f in data["findings"]]
    return Report(**data)
