"""``--precision bf16-compute`` under torchrun at 2 processes (``tests/support/compute_dtype_worker.py``,
one launch for ddp and fsdp): each backend's weights after a few AdamW steps of the GPT against one
process's with the same precision, and the weights a forward computes on are bfloat16 (fsdp's
gathered unit, ddp's copy) while the optimizer steps float32 ones.

The tolerance is measured (docs/loops.md, "Precision"): at 2 processes against one, the largest
relative difference per tensor is 1.0e-2 under bf16-compute (9.8e-3 under bf16-mixed; 2.4e-6 under
``32``, the floor of summation order), so three times that.
"""

from __future__ import annotations

from pathlib import Path

import compute_dtype_worker as worker
import pytest
import torch
from launching import rel_err, worker_reports

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(300)]

TOLERANCE = 3e-2


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[list[dict], Path]:
    cases = {"torchrun": ("torchrun", "ddp", ["--precisions", "bf16-compute"])}
    reports = worker_reports("torchrun", cases, "compute_dtype_worker.py", tmp_path_factory, timeout=240)
    out = next(tmp_path_factory.getbasetemp().glob("compute_dtype_worker-torchrun*"))
    return reports, out


@pytest.mark.parametrize("case", ["ddp", "fsdp"])
def test_bf16_compute_computes_in_bfloat16_and_matches_one_process(case, launched):
    reports, out = launched
    for r in reports:
        seen = r[f"{case}-bf16-compute"]
        assert seen["weight_in_forward"] == "torch.bfloat16", seen  # fsdp: the gathered unit
        assert seen["stepped"] == ["torch.float32"] and seen["loss"] == "torch.float32", seen
    weights = torch.load(out / f"{case}-bf16-compute.pt")
    assert {t.dtype for t in weights.values()} == {torch.float32}
    one = worker.reference("bf16-compute")
    assert rel_err(weights, one) < TOLERANCE
