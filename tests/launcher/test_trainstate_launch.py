"""Training-state checkpoints under the real launchers, 2 processes each
(``tests/support/trainstate_worker.py``, SGD with momentum and AdamW in every launch).

Per backend: save after 3 steps and train 2 more (A), then reload into fresh
objects and train 2 more (B): A == B bitwise.  The file's optimizer state is
whole (keyed by name, nothing None) and, ZeRO-sharded or not, equal to the
ddp run's within REL_TOL.  The ddp launch also loads the ZeRO-3 checkpoint,
and the ZeRO-2 launch ddp's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from core_runs import core_cases, core_run
from launching import backend_cases
from trainstate_worker import max_diff

# Every backend case: the section rides in each case's core launch anyway.
CASES = backend_cases()
OPTIMIZERS = ("sgd", "adamw")
# Across backends only the order of float additions in the gradient average differs.
REL_TOL = 1e-6

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(900)]


def run_case(name: str, tmp_path_factory: pytest.TempPathFactory, *, continued: bool = True) -> Path:
    """The trainstate section of the case's one core launch (tests/support/core_runs.py), in which ddp
    continues ZeRO-3's checkpoint and ZeRO-2 continues ddp's (scattered into its shards)."""
    return core_run(name, tmp_path_factory, continued=continued)[0] / "trainstate"


@pytest.fixture(params=core_cases())
def case(request, tmp_path_factory):
    return request.param, run_case(request.param, tmp_path_factory)


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(max_diff(a[k], b[k]) / max(float(b[k].abs().max()), 1e-12) for k in b)


@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_resume_is_bitwise_exact(case, optim):
    name, out = case
    r = torch.load(out / f"result-{optim}.pt", weights_only=True)
    assert r["world_size"] == 2
    assert max_diff(r["A"], r["B"]) == 0.0, f"{name}: weights after resuming differ from the uninterrupted run"
    assert torch.equal(r["rng_A"], r["rng_B"]), f"{name}: the RNG did not continue identically"
    assert r["counters_A"] == r["counters_B"]
    assert r["loaded_model_diff"] == 0.0 and r["loaded_optimizer_diff"] == 0.0, "loaded state differs from the file"
    assert (
        r["engine_A"] == r["engine_B"] and r["engine_loaded"] == r["info"]["meta"]["step"]
        if r["engine_A"] is not None
        else True
    )


@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_optimizer_state_is_whole_and_matches_ddp(case, optim, tmp_path_factory):
    name, out = case
    state = torch.load(out / optim / "checkpoints" / "step-00000003" / "state.pt", weights_only=True)
    reference = torch.load(
        run_case("ddp", tmp_path_factory, continued=False) / optim / "checkpoints" / "step-00000003" / "state.pt",
        weights_only=True,
    )
    opt, ref = state["optimizer"], reference["optimizer"]
    names = list(state["model"])
    assert sorted(opt["state"]) == sorted(names) and sorted(opt["param_groups"][0]["params"]) == sorted(names)
    keys = {"sgd": {"momentum_buffer"}, "adamw": {"exp_avg", "exp_avg_sq", "step"}}[optim]
    for n in names:
        assert set(opt["state"][n]) == keys, f"{name}: state of {n} is {sorted(opt['state'][n])}"
        for k in keys:
            mine, theirs = opt["state"][n][k], ref["state"][n][k]
            assert mine.shape == theirs.shape, f"{name}: {n}.{k} has shape {tuple(mine.shape)}"
            err = max_diff(mine, theirs) / max(float(theirs.abs().max()), 1e-12)
            assert err <= REL_TOL, f"{name}: {n}.{k} differs from ddp's by {err:.2e} (relative)"
    assert _rel(state["model"], reference["model"]) <= REL_TOL
    groups = [
        {k: v for k, v in g.items() if k in ("lr", "momentum", "weight_decay", "betas", "initial_lr")}
        for g in opt["param_groups"]
    ]
    assert groups == [{k: v for k, v in g.items() if k in groups[0]} for g in ref["param_groups"]]
    portable = torch.load(out / f"result-{optim}.pt", weights_only=True)["portable"]
    assert portable is not None and len(portable["state"]) == len(names)  # backend.save's form: whole too
    assert state["meta"]["world_size"] == 2 and state["meta"]["optimizer"] == {"sgd": "SGD", "adamw": "AdamW"}[optim]
    files = sorted(p.name for p in (out / optim / "checkpoints" / "step-00000003").iterdir())
    assert files == ["rng-rank0.pt", "rng-rank1.pt", "state.pt"]


@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_zero3_checkpoint_loads_into_ddp(optim, tmp_path_factory):
    out = run_case("ddp", tmp_path_factory)
    cross = torch.load(out / f"cross-{optim}.pt", weights_only=True)
    zero3 = torch.load(run_case("deepspeed-zero3", tmp_path_factory) / f"result-{optim}.pt", weights_only=True)
    assert cross["info"]["meta"]["backend"] == "deepspeed" and cross["info"]["meta"]["zero_stage"] == 3
    assert cross["loaded_model_diff"] == 0.0 and cross["loaded_optimizer_diff"] == 0.0
    assert torch.equal(cross["rng_C"], zero3["rng_B"]), "the RNG continues as it did under ZeRO-3"
    assert _rel(cross["C"], zero3["B"]) <= REL_TOL, "ddp continues ZeRO-3's run (up to reduction order)"


@pytest.mark.scenario  # ZeRO-2's core launch is a scenario
@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_ddp_checkpoint_loads_into_zero2(optim, tmp_path_factory):
    out = run_case("deepspeed-zero2", tmp_path_factory)
    cross = torch.load(out / f"cross-{optim}.pt", weights_only=True)
    ddp = torch.load(run_case("ddp", tmp_path_factory, continued=False) / f"result-{optim}.pt", weights_only=True)
    assert cross["info"]["meta"]["backend"] == "ddp"
    assert cross["loaded_model_diff"] == 0.0 and cross["loaded_optimizer_diff"] == 0.0
    assert torch.equal(cross["rng_C"], ddp["rng_B"]), "the RNG continues as it did under ddp"
    assert _rel(cross["C"], ddp["B"]) <= REL_TOL, "ZeRO-2 continues ddp's run (up to reduction order)"


@pytest.mark.parametrize("optim", OPTIMIZERS)
@pytest.mark.parametrize("loader,source", [("fsdp", "ddp"), ("deepspeed-zero1", "fsdp")])
def test_checkpoints_move_between_fsdp_and_others(loader, source, optim, tmp_path_factory):
    """fsdp continues ddp's run (its whole tensors cut into shards), ZeRO-1 fsdp's (gathered from shards)."""
    out = run_case(loader, tmp_path_factory)
    cross = torch.load(out / f"cross-{optim}.pt", weights_only=True)
    theirs = torch.load(run_case(source, tmp_path_factory) / f"result-{optim}.pt", weights_only=True)
    assert cross["info"]["meta"]["backend"] == CASES[source][1]
    assert cross["loaded_model_diff"] == 0.0 and cross["loaded_optimizer_diff"] == 0.0
    assert torch.equal(cross["rng_C"], theirs["rng_B"]), f"the RNG continues as it did under {source}"
    assert _rel(cross["C"], theirs["B"]) <= REL_TOL, f"{loader} continues {source}'s run (up to reduction order)"
