"""Reading the verdicts of ``tests/support/hangs_worker.py``'s runs: under each launcher
(``tests/launcher/test_hangs.py``), under Slurm's srun (``tests/system/test_slurm.py``) and across
two machines (``tests/system/test_netns.py``)."""

from __future__ import annotations

import re
from pathlib import Path

WORKER = Path(__file__).resolve().parent / "hangs_worker.py"


def lines(part: str) -> list[str]:
    """The worker's lines marked ``# PART:<part>``, as ``hangs_worker.py:N``."""
    text = WORKER.read_text().splitlines()
    return [f"{WORKER.name}:{i}" for i, line in enumerate(text, 1) if f"# PART:{part}" in line]


def verdicts(output: str) -> dict[int, str]:
    """Each rank's printed verdict, by rank."""
    return {int(r): text for r, text in re.findall(r"parallelx: verdict \(rank (\d+)\): (.*)", output)}


def one_verdict(output: str, world_size: int = 2) -> str:
    """The verdict every one of ``world_size`` ranks printed, the same words on each (else the test fails)."""
    found = verdicts(output)
    assert set(found) == set(range(world_size)), f"not every rank printed a verdict:\n{output[-4000:]}"
    assert len(set(found.values())) == 1, found
    return found[0]
