"""Gradients compressed on the wire (``--grad-compression fp16|bf16``) under every backend's
real launcher (``tests/support/compression_worker.py``: one launch per backend case, DeepSpeed's stages
sharing one, every wire type in it), against ddp's weights with the same wire type.

Each engine rounds the compressed all-reduce its own way (where the cast happens, whether it
divides by the world size before or after the sum, in which type), so the backends do not
agree to the bit under compression; docs/loops.md's table gives the measured differences.
What this test holds:

- without compression every backend gives ddp's weights within the float32 summation floor
  (1e-6), the floor the compressed figures are read against;
- with compression each backend's weights differ from its own uncompressed run (the wire type
  is really applied: otherwise the table would measure nothing);
- each backend stays within ``BOUND`` of ddp under each wire type it offers (about twice the
  table's largest figure), and ZeRO-3 and fsdp give ddp's weights to the bit;
- where a backend does not offer a wire type (Horovod: bfloat16), it says so with a
  ``ParallelxError``.

The table itself: ``.venv/bin/python -m pytest -m scenario tests/system/test_compression.py -s``
prints it.
"""

from __future__ import annotations

import json

import pytest
import torch
from launching import backend_cases, deepspeed_together, launch, require_launcher

CASES = backend_cases()
FLOOR = 1e-6
RUNS = ("none", "fp16", "bf16", "none-small", "fp16-small")
#: Per run: about twice the largest relative difference from ddp in docs/loops.md's table (4.8e-5, 0,
#: 0.14; the runs are deterministic, the margin is for another machine's kernels).
BOUND = {"fp16": 1e-4, "bf16": FLOOR, "fp16-small": 0.3}
#: Reduce-scatter in the wire type and divide as ddp does: ddp's weights to the bit, every wire type.
DDP_BITS = {"deepspeed-zero3", "fsdp"}

pytestmark = [pytest.mark.launcher, pytest.mark.scenario, pytest.mark.timeout(900)]

_RESULTS: dict[str, dict] = {}
#: DeepSpeed's stages, which share one launch.
STAGES = deepspeed_together(CASES)


def rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].double() - b[k].double()).norm() / b[k].double().norm()) for k in b)


def run_case(case: str, tmp_path_factory) -> dict:
    """One launch of ``case`` (DeepSpeed's stages share one, ``--stages``): per run, the weights or the
    backend's refusal (kept for the module)."""
    if case not in _RESULTS:
        launcher, backend, extra = CASES[case]
        require_launcher(launcher)
        shared = case in STAGES
        out = tmp_path_factory.mktemp(f"compression-{'deepspeed' if shared else case}")
        if shared:
            extra = ["--stages", *(CASES[c][2][-1] for c in STAGES)]
        res = launch(
            launcher,
            ["tests/support/compression_worker.py", "--backend", backend, "--out", str(out), *extra],
            timeout=400 * (len(STAGES) if shared else 1),
        )
        assert res.returncode == 0, f"{case}:\n{res.tail(60)}"
        for name in STAGES if shared else (case,):
            folder = out / f"zero{CASES[name][2][-1]}" if shared else out
            report = json.loads((folder / "report.json").read_text())
            _RESULTS[name] = {
                run: entry.get("error") or torch.load(folder / entry["weights"], weights_only=True)
                for run, entry in report.items()
            }
    return _RESULTS[case]


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory) -> tuple[str, dict, dict]:
    """(name, its runs, ddp's runs); prints the case's row of docs/engines.md's table."""
    ddp = run_case("ddp", tmp_path_factory)
    mine = run_case(request.param, tmp_path_factory)
    cells = [("refused" if isinstance(mine[r], str) else f"{rel(mine[r], ddp[r]):.2g}") for r in RUNS]
    own = [f"{rel(mine[r], mine[u]):.2g}" for r, u in (("fp16", "none"), ("fp16-small", "none-small"))]
    print(f"\n| {request.param} | " + " | ".join(cells) + " | " + " | ".join(own) + " |")
    return request.param, mine, ddp


def test_without_compression_every_backend_gives_ddps_weights(case):
    name, mine, ddp = case
    for run in ("none", "none-small"):
        assert rel(mine[run], ddp[run]) < FLOOR, (name, run)


def test_the_wire_type_is_applied_and_stays_near_ddps(case):
    name, mine, ddp = case
    for run, uncompressed in (("fp16", "none"), ("bf16", "none"), ("fp16-small", "none-small")):
        if isinstance(mine[run], str):
            continue
        assert rel(mine[run], mine[uncompressed]) > FLOOR, f"{name} {run}: the same weights as without compression"
        assert rel(mine[run], ddp[run]) < BOUND[run], (name, run, rel(mine[run], ddp[run]))
        if name in DDP_BITS:
            assert rel(mine[run], ddp[run]) == 0, (name, run, rel(mine[run], ddp[run]))


def test_a_wire_type_a_backend_lacks_is_refused_by_name(case):
    name, mine, _ = case
    refused = {run for run, v in mine.items() if isinstance(v, str)}
    assert refused == ({"bf16"} if name == "horovod" else set()), (name, refused)
    for run in refused:
        assert run in mine[run], (name, run, mine[run])
