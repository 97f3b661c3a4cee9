"""Weight averages, frozen weights and training-state checkpoints of several
objects under every backend's real launcher, 2 processes on the CPU
(``tests/support/ema_worker.py``: one launch per backend case runs every
check), against plain PyTorch on one process computed in the same worker.

- ``parallelx.EMA`` (torch's EMA function, every 2 steps) and a hand-written
  average equal torch's ``AveragedModel`` on one process; a forward with the
  averaged weights equals ``AveragedModel``'s and leaves the model's weights
  bitwise as they were; under fsdp and ZeRO-3 each rank holds its share of
  the average, elsewhere the whole; the portable file loads into the plain model.
- A partly frozen model (frozen encoder and head, LoRA-style adapters): the
  same numbers; the frozen weights get no gradient, do not move, are not in
  the optimizer state, and are not among the elements the gradient sync reduces.
- A GAN with an EMA of G, two optimizers, two schedulers and a sampler in a
  ``parallelx.Checkpointer``: resumed bitwise; the checkpoint holds the EMA whole.

Tolerance: 1e-6 relative per tensor (float32 summation order of the gradient
average; the averages are elementwise and add no error of their own).
"""

from __future__ import annotations

import pytest
from launching import backend_cases, deepspeed_together, in_make_test, worker_reports

CASES = backend_cases()
TOL = 1e-6

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(900)]


# make test runs the cases that shard (and ddp, the reference); the others are scenarios (CI runs both).
@pytest.fixture(
    scope="module",
    params=in_make_test(CASES),
    ids=list(CASES),
)
def reports(request, tmp_path_factory) -> tuple[str, list[dict]]:
    found = worker_reports(
        request.param, CASES, "ema_worker.py", tmp_path_factory, timeout=400, together=deepspeed_together(CASES)
    )
    for rep in found:
        for case, result in rep.items():
            assert "error" not in result, (case, result["error"])
    return request.param, found


def shards_expected(case: str) -> bool:
    return case in ("fsdp", "deepspeed-zero3")


def test_ema_equals_one_process_averaged_model(reports):
    _, found = reports
    for rep in found:
        e = rep["ema"]
        assert e["rel_err_model"] < TOL, e
        assert e["rel_err_ema"] < TOL, e
        assert e["rel_err_hand"] < TOL, e
        assert e["n_averaged"] == [3, 3]
        assert e["rel_err_forward"] < TOL, e
        assert e["rel_err_portable"] < TOL, e


def test_ema_swap_leaves_the_model_as_it_was(reports):
    _, found = reports
    for rep in found:
        assert rep["ema"]["swap_restored"] is True


def test_ema_is_sharded_as_the_model(reports):
    case, found = reports
    total = found[0]["ema"]["total_numel"]
    local = [rep["ema"]["local_numel"] for rep in found]
    if shards_expected(case):
        assert all(rep["ema"]["sharded"] for rep in found)
        # Each rank's share, none whole; ZeRO-3 pads each parameter's partition to a multiple of the world size.
        assert all(n < total for n in local), (local, total)
        assert total <= sum(local) <= total + 2 * 4, (local, total)
        assert all(rep["gan_resume"]["local_ema_numel"] < rep["gan_resume"]["total_numel"] for rep in found)
    else:
        assert local == [total, total]


def test_frozen_weights_same_numbers_not_reduced_not_in_the_optimizer(reports):
    _, found = reports
    for rep in found:
        f = rep["frozen"]
        assert f["rel_err"] < TOL, f
        assert f["frozen_moved"] is False
        assert f["frozen_grads"] == []
        assert f["optimizer_state_names"] == f["trainable_names"]
        assert f["optimizer_group_names"] == f["trainable_names"]
        # Something was reduced (the count sees the sync), and never the frozen weights.
        assert f["reduced_numel"] > 0, f
        assert f["reduced_numel"] < f["frozen_numel"], f


def test_gan_with_ema_resumes_bitwise_through_the_checkpointer(reports):
    _, found = reports
    for rep in found:
        g = rep["gan_resume"]
        assert g["bitwise"] == dict.fromkeys(("g", "d", "ema", "g_opt", "d_opt", "lr"), True), g
        assert g["moved"] is True
        assert g["saved_ema_numel"] == g["total_numel"]  # whole in the checkpoint


def test_every_rank_ends_with_the_same_numbers(reports):
    _, (rank0, rank1) = reports
    for case in rank0:
        skip = {"seconds", "local_numel", "local_ema_numel", "reduced_numel", "reduced", "rel_err_forward"}
        assert {k: v for k, v in rank0[case].items() if k not in skip} == {
            k: v for k, v in rank1[case].items() if k not in skip
        }, case
