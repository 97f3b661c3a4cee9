"""The launcher tier's shared launches: the checks that
need only a backend share one launch per backend case (``core_worker``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launching import BACKEND_CASES, Result, in_make_test, launch, require_launcher

#: The trainstate section continues another backend's checkpoint: ddp
#: ZeRO-3's, ZeRO-2 ddp's, fsdp ddp's, ZeRO-1 fsdp's (both directions across backends).
LOAD_FROM = {"ddp": "deepspeed-zero3", "deepspeed-zero2": "ddp", "fsdp": "ddp", "deepspeed-zero1": "fsdp"}
#: case -> (its output folder, its result, whether it continued LOAD_FROM's checkpoint)
_RUNS: dict[str, tuple[Path, Result, bool]] = {}
#: The cases whose core launch make test runs: torchrun's backends and DeepSpeed's launcher at the stage
#: that partitions the optimizer state and at the one that partitions the parameters; ZeRO-0, ZeRO-2
#: and Horovod (whose build alone takes 4 CPU-minutes on a fresh machine) are scenarios, which CI runs
#: after make test.
IN_MAKE_TEST = ("ddp", "deepspeed-zero1", "deepspeed-zero3", "fsdp")


def core_cases() -> list:
    """The backend cases as the core launches' pytest params (see :data:`IN_MAKE_TEST`)."""
    return in_make_test(BACKEND_CASES, *IN_MAKE_TEST)


def core_run(case: str, tmp_path_factory: pytest.TempPathFactory, *, continued: bool = True) -> tuple[Path, Result]:
    """The one core launch of ``case`` (run on first use, kept for the session): its output folder and result.

    ``continued=False``: the launch is wanted for its own files (another case's checkpoint to continue,
    a reference), not for its continuing of :data:`LOAD_FROM`'s checkpoint, so it needs no launch of that
    case first (the scenario tier runs ddp's core launch as ZeRO-2's source without ZeRO-3's before it)."""
    source = LOAD_FROM.get(case)
    wanted = continued and source is not None
    if case not in _RUNS or (wanted and not _RUNS[case][2]):
        launcher, backend, extra = BACKEND_CASES[case]
        require_launcher(launcher)
        if wanted:
            from_dir = core_run(source, tmp_path_factory, continued=False)[0] / "trainstate"
            extra = [*extra, "--load-from", str(from_dir)]
        out = tmp_path_factory.mktemp(f"core-{case}")
        res = launch(
            launcher, ["tests/support/core_worker.py", "--backend", backend, "--out", str(out), *extra], timeout=420
        )
        assert res.returncode == 0, f"{launcher} core job of {case} failed (exit {res.returncode}):\n{res.tail(80)}"
        _RUNS[case] = (out, res, wanted)
    out, res, _ = _RUNS[case]
    return out, res


def section_reports(case: str, section: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Each rank's ``rank<r>.json`` of one section of the core launch."""
    out, _ = core_run(case, tmp_path_factory)
    return [json.loads((out / section / f"rank{r}.json").read_text()) for r in range(2)]
