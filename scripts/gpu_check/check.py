"""How the GPU check runs its steps: each against the deadline, its outcome
recorded as an :class:`~gpu_check.report.Item`, the report rewritten after
every one."""

from __future__ import annotations

import datetime as dt
import json
import os
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .report import FAILED, PASSED, SKIPPED, Item, render_markdown, section_status
from .settings import RESERVE_S, SECTIONS, Settings


class Skip(Exception):
    """A step that did not run; the message says why."""


class Fail(Exception):
    """A step whose check failed; the message says what was expected."""

    def __init__(self, message: str, *, log: str | None = None, figures: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.log = log
        self.figures = figures or {}


@dataclass
class Outcome:
    detail: str
    figures: dict[str, Any] = field(default_factory=dict)


class Check:
    """Runs steps against a deadline and keeps the report up to date."""

    def __init__(self, out: Path, work: Path, deadline: float, settings: Settings, nproc: int,
                 only: Sequence[str] = SECTIONS) -> None:
        self.out, self.work, self.deadline, self.settings, self.nproc = out, work, deadline, settings, nproc
        self.only = set(only)
        self.items: list[Item] = []
        self.env_text = ""
        self.facts: dict[str, Any] = {}
        self.started = time.time()

    def remaining(self) -> float:
        return self.deadline - time.time()

    def timeout(self, cap: float) -> float:
        """A step's timeout: its own cap, or what is left of the budget."""
        return max(1.0, min(cap, self.remaining() - RESERVE_S))

    def record(self, item: Item) -> Item:
        self.items.append(item)
        line = f"[gpu-check] {item.section} / {item.name}: {item.status} in {item.seconds:.1f}s"
        print(line + (f"  ({item.detail})" if item.detail else ""), flush=True)
        self.write()
        return item

    def skip(self, section: str, name: str, reason: str, *, needs: str | None = None) -> Item:
        return self.record(Item(section, name, SKIPPED, reason, needs=needs))

    def step(self, section: str, name: str, fn: Callable[[], Outcome], *, need_s: float = 0.0,
             needs: str | None = None) -> Item:
        """Run ``fn`` as one check; it returns an :class:`Outcome`, or raises
        :class:`Skip` or :class:`Fail`.  Any other exception fails the step
        with its traceback in the log."""
        if section not in self.only:
            return self.skip(section, name, "not selected (--only)", needs=needs)
        left = self.remaining() - RESERVE_S
        if left < need_s:
            return self.skip(section, name, f"out of time: {max(0, left):.0f}s of the budget left, "
                                            f"this step needs about {need_s:.0f}s", needs=needs)
        start = time.monotonic()
        item = Item(section, name, PASSED, needs=needs)
        try:
            outcome = fn()
            item.detail, item.figures = outcome.detail, outcome.figures
        except Skip as exc:
            item.status, item.detail = SKIPPED, str(exc)
        except Fail as exc:
            item.status, item.detail, item.log, item.figures = FAILED, str(exc), exc.log, exc.figures
        except Exception as exc:  # a broken step must not stop the others
            item.status, item.detail = FAILED, f"{type(exc).__name__}: {exc}"
            item.log = traceback.format_exc()
        item.seconds = time.monotonic() - start
        return self.record(item)

    # ------------------------------------------------------------ writing

    def summary(self) -> dict[str, Any]:
        sections = {}
        for name in SECTIONS:
            items = [i for i in self.items if i.section == name]
            sections[name] = {"status": section_status(items),
                              "items": [{k: v for k, v in asdict(i).items() if k not in ("section", "log")}
                                        for i in items]}
        counts = {s: sum(i.status == s for i in self.items) for s in (PASSED, FAILED, SKIPPED)}
        return {"result": FAILED if counts[FAILED] else PASSED, "mode": "cuda" if self.settings.cuda else "dry-run",
                "nproc": self.nproc, "counts": counts, "seconds": round(time.time() - self.started, 1),
                "started": dt.datetime.fromtimestamp(self.started, dt.timezone.utc).isoformat(timespec="seconds"),
                "environment": self.facts, "logs": str(self.work / "logs"), "sections": sections,
                "skipped_cuda_only": [f"{i.section} / {i.name}" for i in self.items
                                      if i.status == SKIPPED and i.needs == "cuda"]}

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        summary = self.summary()
        _write_atomic(self.out / "summary.json", json.dumps(summary, indent=1, default=str) + "\n")
        _write_atomic(self.out / "report.md", render_markdown(summary, self.items, self.env_text))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
