"""recipes/example.py, the loop a user writes, under every launcher: ddp
(torchrun), horovod (horovodrun), deepspeed ZeRO 0 (the deepspeed launcher,
file form) and fsdp (torchrun) with 2 processes of 32 samples each, and single in one process on
the global batch of 64.  Each run exits 0, prints its validation lines and
writes a file that ``torch.load(weights_only=True)`` reads; the printed
validation figures equal a one-process evaluation of the saved weights here;
and the final weights agree across the runs within 1e-6 relative (only the
order of float additions differs)."""

from __future__ import annotations

import re

import pytest
import torch
from launching import backend_cases, in_make_test, launch, rel_err, require_launcher

EPOCHS, SEED = 2, 0
# single sees the global batch (2 x 32) in one process: the same update as the others.
RUNS: dict[str, tuple[str, str, list[str]]] = {
    "single": ("python", "single", ["--batch-size", "64"]),
    **backend_cases("ddp", "horovod", "deepspeed-zero0", "fsdp"),
}
REL_TOL = 1e-6
VAL_LINE = re.compile(
    rf"epoch {EPOCHS}/{EPOCHS}: train loss [\d.]+ \| val loss (?P<loss>[\d.]+) "
    r"acc (?P<acc>[\d.]+) \((?P<correct>\d+)/(?P<count>\d+)\)"
)

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(240)]
_DONE: dict[str, dict[str, torch.Tensor]] = {}


@pytest.mark.parametrize("run", in_make_test(RUNS, "single"))
def test_example_runs_and_agrees_under_every_launcher(run, tmp_path):
    launcher, backend, extra = RUNS[run]
    require_launcher(launcher)
    target = ["recipes/example.py"] if launcher == "deepspeed" else ["-m", "recipes.example"]
    out = tmp_path / "example.pth"
    res = launch(
        launcher,
        [*target, "--backend", backend, *extra, "--epochs", str(EPOCHS), "--seed", str(SEED), "--out", str(out)],
        nproc=1 if launcher == "python" else 2,
        timeout=200,
    )
    assert res.returncode == 0, res.tail()
    shown = VAL_LINE.search(res.output)
    assert shown is not None, f"no validation line for the last epoch:\n{res.tail()}"
    assert len(re.findall(r"epoch \d+/\d+: train loss", res.output)) == EPOCHS, res.tail()  # rank 0 alone prints
    assert f"saved {out}" in res.output

    saved = torch.load(out, weights_only=True)
    assert saved.keys() == {"model", "optimizer", "epochs"} and saved["epochs"] == EPOCHS
    assert saved["optimizer"]["state"], "the optimizer's momentum was not saved"

    from recipes.example import make_datasets, make_model
    from recipes.models import evaluate_state_dict

    # The distributed validation (each rank its shard, the padding left out) is
    # what one process computes with the saved weights.
    model = make_model()
    model.load_state_dict(saved["model"])
    _, val_set = make_datasets(SEED)
    ref = evaluate_state_dict(model, val_set)
    assert int(shown["count"]) == ref["count"] == len(val_set)
    assert int(shown["correct"]) == ref["correct"], f"printed {shown[0]!r}, one process: {ref}"
    assert float(shown["acc"]) == pytest.approx(ref["acc"], abs=5e-5)
    assert float(shown["loss"]) == pytest.approx(ref["loss"], abs=5e-5)  # printed to 4 decimals

    _DONE[run] = saved["model"]
    for other, weights in _DONE.items():
        if other != run:
            err = rel_err(saved["model"], weights)
            assert err < REL_TOL, f"{run} vs {other}: final weights differ by {err:.3g} relative"
