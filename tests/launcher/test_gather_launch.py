"""Gathering and synchronised BatchNorm under the real launchers, 2 processes
each, on the CPU: one launch per launcher runs every check
(``tests/support/gather_worker.py``); the tests below read what each rank reported."""

from __future__ import annotations

import pytest
from core_runs import core_cases, core_run, section_reports
from launching import backend_cases

# ZeRO-3 partitions the parameters: the converted BatchNorm must still see whole ones.
CASES = backend_cases()
DATASET_SIZE = 23
# Float32 results against one process; the statistics are summed in float64.
TOL = 1e-6

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(900)]


@pytest.fixture(scope="module", params=core_cases())
def job(request, tmp_path_factory):
    _, res = core_run(request.param, tmp_path_factory)  # the case's one core launch (tests/support/core_runs.py)
    reports = section_reports(request.param, "gather", tmp_path_factory)
    assert [rep["world_size"] for rep in reports] == [2, 2]
    _OUTPUT[request.param] = res.output
    return reports


_OUTPUT: dict[str, str] = {}


def test_uneven_first_dims_concatenate_in_rank_order(job):
    for rep in job:
        g = rep["gather"]
        assert g["uneven"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert g["scalar"] == [10, 11]
        assert g["bool"] == [True, True, False, True]
        assert g["some_empty"] == [2, 3]


def test_mismatched_dtype_or_shape_is_one_clear_error_on_every_rank(job):
    for rep in job:
        g = rep["gather"]
        assert g["dtype_error"] is not None and "same dtype" in g["dtype_error"]
        assert "rank 0: [2] torch.float32" in g["dtype_error"] and "rank 1: [2] torch.float64" in g["dtype_error"]
        assert g["shape_error"] is not None and "rank 0: [2, 3]" in g["shape_error"]
        assert "rank 1: [2, 4]" in g["shape_error"]


def test_objects_one_per_rank(job):
    for rep in job:
        objects = rep["gather"]["objects"]
        assert [o["rank"] for o in objects] == [0, 1]
        assert [len(o["text"]) for o in objects] == [1, 101]
        assert [o["tuple"] for o in objects] == [[0, None], [1, None]]  # JSON made the tuples lists


def test_gather_in_order_is_dataset_order_without_padding(job):
    shards = [rep["gather"]["shard_values"] for rep in job]
    assert job[0]["gather"]["sampler_padding"] == 1
    # The pass was shuffled (else this test would not test the order) and padded.
    assert sorted(shards[0] + shards[1]) != shards[0] + shards[1]
    assert len(shards[0] + shards[1]) == DATASET_SIZE + 1
    expected = [[float(i), 2.0 * i] for i in range(DATASET_SIZE)]
    for rep in job:
        assert rep["gather"]["in_order"] == expected


def test_gather_in_order_misuse_errors(job):
    for rep in job:
        g = rep["gather"]
        assert g["partial_error"] is not None and "gave [12, 11] rows" in g["partial_error"]
        assert g["sampler_error"] is not None and "ShardedSampler" in g["sampler_error"]
        assert "DistributedSampler" in g["sampler_error"] and "make_sampler" in g["sampler_error"]


def test_sync_batchnorm_on_cpu_matches_one_process(job):
    for rep in job:
        bn = rep["batchnorm"]
        assert "error" not in bn, bn.get("error")
        assert "SyncBatchNorm" in bn["converted"] and "BatchNorm2d" not in bn["converted"]
        assert bn["state_keys_same"]
        assert bn["out_err"] < TOL
        assert bn["grad_x_err"] < TOL
        assert bn["grad_param_rel_err"] < TOL
        assert bn["running_err"] < TOL
        assert bn["eval_err"] < TOL


def test_converted_model_steps_under_the_backends_wrapper(job):
    for rep in job:
        assert rep["batchnorm"]["wrapped_step_ok"]
        assert rep["batchnorm"]["wrapped_state_spread"] == 0.0


def test_distributed_validation_equals_one_process_on_the_saved_weights(job):
    """Plain BatchNorm trained on per-rank shards: after every step each rank
    holds rank 0's buffers, so the ranks' validation is the checkpoint's."""
    for rep in job:
        b = rep["buffers"]
        for tag in ("trained", "resumed"):
            dist, one = b[f"{tag}_dist"], b[f"{tag}_one_process"]
            assert dist["count"] == one["count"] == 23, tag  # the padding duplicate left out
            assert dist["correct"] == one["correct"], (tag, dist, one)
            assert dist["loss"] == pytest.approx(one["loss"], rel=1e-6, abs=0), (tag, dist, one)
            assert b[f"{tag}_spread"] == 0.0, tag  # every rank's running statistics are rank 0's
        assert b["loaded_spread"] == 0.0
        assert b["resumed_dist"]["loss"] != b["trained_dist"]["loss"]  # the resumed run trained on
    assert job[0]["buffers"]["trained_dist"] == job[1]["buffers"]["trained_dist"]
    cost = job[0]["buffers"]["cost"]
    print(
        f"buffer broadcast after a ResNet-18 step: {cost['sync_ms']:.2f} ms of a {cost['step_ms']:.1f} ms step "
        f"({cost['sync_ms'] / cost['step_ms']:.1%})"
    )


def test_one_true_batchnorm_warning_per_job(request, job):
    """Plain BatchNorm warns once per job, on every backend; the model passed
    through sync_batchnorm first does not."""
    output = _OUTPUT[request.node.callspec.params["job"]]
    assert output.count("BatchNorm layers normalise with each process's own batch statistics") == 1, output[-3000:]
