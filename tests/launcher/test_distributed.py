"""The backends under their real launchers, 2 processes each, on the CPU.

One launch per backend runs every check (``tests/support/dist_worker.py``); the tests
below read what each rank reported.  The training checks use gradient norms in
the hundreds, momentum, weight decay and an LR schedule, with the protocol in
both forms (``setup`` and ``wrap_model`` + ``wrap_optimizer``): a backend that
clips, rescales or double-steps by default is off by far more than REL_TOL.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from core_runs import core_cases, core_run, section_reports
from launching import _BY_LAUNCHER, BLOCK_BACKEND_PACKAGES, ROOT, backend_cases

CASES = backend_cases()  # ZeRO-3 shards the parameters themselves: saving must gather them collectively
# Relative tolerance on the weights after 5 SGD steps: only the order of float
# additions differs (gradient averaging across ranks), ~2e-7 is typical.  With
# DeepSpeed's former default clipping (1.0) the error is ~1, measured.
REL_TOL = 1e-6
DATASET_SIZE = 23

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(900)]


@pytest.fixture(scope="module", params=core_cases())
def job(request, tmp_path_factory):
    out, _ = core_run(request.param, tmp_path_factory)  # the case's one core launch (tests/support/core_runs.py)
    return {
        "out": out / "dist",
        "reports": section_reports(request.param, "dist", tmp_path_factory),
        "backend": CASES[request.param][1],
        "auto": _BY_LAUNCHER[CASES[request.param][0]],
    }


def test_world_and_detection(job):
    for r, rep in enumerate(job["reports"]):
        assert rep["rank"] == r and rep["world_size"] == 2 and rep["local_rank"] == r
        assert rep["name"] == job["backend"]
        # auto follows the launcher (torchrun -> ddp): sharding (fsdp) is never picked silently.
        assert rep["detected"] == job["auto"], "get_backend('auto') would pick the wrong backend"
        assert rep["device"] == "cpu"


def test_all_reduce(job):
    # rank r contributes [r + 1, 2r]
    expected = {"sum": [3.0, 2.0], "mean": [1.5, 1.0], "max": [2.0, 2.0], "min": [1.0, 0.0]}
    for rep in job["reports"]:
        assert rep["all_reduce"] == expected
        assert rep["all_reduce_input_unchanged"]
        assert rep["all_reduce_int_mean"] == [0.5]
        assert rep["broadcast_obj"] == {"from": 0}
        assert rep["broadcast_tensor"] == [5.0]


def test_last_collectives_are_held_past_exit(job):
    # Gloo's worker thread must not be the one to free a finished collective at
    # interpreter shutdown (it aborts the process there): the backend keeps the
    # handles.  Horovod does not use torch.distributed.
    if job["backend"] == "horovod":
        pytest.skip("horovod's collectives do not go through torch.distributed")
    for rep in job["reports"]:
        assert rep["last_work_held"]


@pytest.mark.parametrize("model", ["a", "b"], ids=["setup", "wrap_model+wrap_optimizer"])
def test_training_math_matches_one_process(job, model):
    for rep in job["reports"]:
        assert rep[f"ref_min_grad_norm_{model}"] > 50, "the check needs gradient norms far above 1"
        assert rep[f"max_rel_err_vs_single_{model}"] < REL_TOL


def test_optimizer_takes_a_torch_lr_scheduler(job):
    for rep in job["reports"]:
        assert rep["optimizers_are_torch_optimizers"]
        assert rep["rng_untouched_by_setup"]
        for model in ("a", "b"):
            assert rep[f"lrs_{model}"] == rep[f"ref_lrs_{model}"], "one scheduler step per optimizer step"


def test_parameters_identical_on_all_ranks(job):
    for rep in job["reports"]:
        assert rep["param_spread_across_ranks_a"] == 0.0
        assert rep["param_spread_across_ranks_b"] == 0.0


def test_save_by_every_rank_writes_one_plain_file(job):
    ckpt = job["out"] / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["model.pth", "state.pth"], "stray or missing files"
    for rep in job["reports"]:
        assert rep["ckpt_files_seen"] == ["model.pth", "state.pth"], "a rank returned before the file existed"
        assert rep["ckpt_step"] == 5 and rep["ckpt_matches_ref"] < 1e-6
    # The file loads with plain torch, with horovod and deepspeed unimportable.
    code = (
        BLOCK_BACKEND_PACKAGES
        + f"""
import torch
state = torch.load({str(ckpt / "state.pth")!r}, map_location='cpu', weights_only=True)
model = torch.load({str(ckpt / "model.pth")!r}, map_location='cpu', weights_only=True)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
net.load_state_dict(state['model']); net.load_state_dict(model)
assert not any(k.startswith('module.') for k in model)
print('opt', state['optimizer'] is not None)
"""
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_sampler_shards_disjoint_cover_and_reshuffle(job):
    reports = job["reports"]
    for epoch in ("epoch0", "epoch1"):
        real = [rep["sampler"][epoch][: rep["sampler"]["num_real"]] for rep in reports]
        assert sorted(real[0] + real[1]) == list(range(DATASET_SIZE)), "real samples must cover the dataset once"
        assert len(reports[0]["sampler"][epoch]) == len(reports[1]["sampler"][epoch]), "equal shard lengths"
    for rep in reports:
        assert rep["sampler"]["epoch0"] != rep["sampler"]["epoch1"], "the shuffle must change between epochs"


def test_metrics_count_each_sample_once(job):
    for rep in job["reports"]:
        m = rep["metrics"]
        assert m["count"] == DATASET_SIZE
        assert m["loss"] == pytest.approx(sum(range(DATASET_SIZE)) / DATASET_SIZE, rel=1e-12)
        assert m["correct"] == len(range(0, DATASET_SIZE, 2))


def test_checkpoint_moves_between_backends_and_world_sizes(job, tmp_path):
    """A checkpoint written by 2 ranks of one backend restores into a world of
    one (the single backend), with identical weights and optimizer state."""
    from dist_worker import make_model, make_optimizer

    import parallelx

    backend = parallelx.get_backend("single")
    backend.init()
    state = backend.load(job["out"] / "ckpt" / "state.pth")
    model = make_model()
    model, opt = backend.setup(model, make_optimizer(model))
    backend.load_state_dict(model, state["model"])
    for k, v in model.state_dict().items():
        assert torch.equal(v, state["model"][k])
    if state["optimizer"] is not None:  # None only under ZeRO >= 1, where it is sharded
        backend.load_state_dict(opt, state["optimizer"])
        momentum = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
        assert all(m is not None and m.abs().sum() > 0 for m in momentum)
    else:
        assert job["backend"] == "deepspeed"
