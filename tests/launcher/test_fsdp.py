"""fsdp's own checks under torchrun (``tests/support/fsdp_worker.py``): two
launches in all.  The protocol, the loop options, gathering and the portable
checkpoints run in fsdp's core launch with every other backend's
(``BACKEND_CASES``).

Here: which modules ``shard=`` makes units and the explicit CPU mesh; sharded
training-state checkpoints written by 2 ranks (each rank its own shard file,
no whole tensor in ``state.pt``), resumed bitwise by 2 ranks and, cut anew,
by 1; the convert command's portable file; and a backend that does not shard
(``single``, in this process) resuming the sharded checkpoint from the whole tensors.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launching import ROOT, launch, require_launcher
from trainstate_worker import Run, max_diff

import parallelx

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(300)]
OPTIMIZERS = ("sgd", "adamw")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    require_launcher("torchrun")
    two, one = tmp_path_factory.mktemp("fsdp-2"), tmp_path_factory.mktemp("fsdp-1")
    res = launch("torchrun", ["tests/support/fsdp_worker.py", "--out", str(two)], timeout=200)
    assert res.returncode == 0, res.tail(60)
    res = launch(
        "torchrun", ["tests/support/fsdp_worker.py", "--out", str(one), "--load-from", str(two)], nproc=1, timeout=200
    )
    assert res.returncode == 0, res.tail(60)
    assert "written by 2 rank(s), this run has 1" in res.output
    return {"two": two, "one": one}


def test_units_and_mesh(runs):
    units = json.loads((runs["two"] / "units.json").read_text())
    # Sequential(Linear(8, 64), ReLU, Sequential(Linear(64, 64), Linear(64, 2)), BatchNorm1d(2)): the two
    # Linear layers holding 10 % or more of the parameters each, then the root for the rest.
    assert units["auto"] == ["0", "2.0", "<root>"]
    assert units["types"] == ["0", "2.0", "2.1", "<root>"]
    assert units["callable"] == ["2", "<root>"]
    assert units["mesh"] == ["cpu", [2]] and units["dtensors"]
    assert units["local_rows"] == [32, 32], "each rank holds half of each parameter's rows"


@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_sharded_checkpoint_resumes_bitwise_and_at_another_world_size(runs, optim):
    r = torch.load(runs["two"] / f"result-{optim}.pt", weights_only=True)
    step = Path(r["path"])
    # Every rank wrote its own shard file; state.pt holds no model or optimizer tensors.
    assert sorted(p.name for p in (step / "shards").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    state = torch.load(step / "state.pt", weights_only=True)
    assert state["model"] is None and state["optimizer"]["state"] == {} and state["meta"]["sharded"]
    assert max_diff(r["A"], r["B"]) == 0.0, "resuming the sharded checkpoint differs from the uninterrupted run"
    portable = torch.load(runs["two"] / f"portable-{optim}.pt", weights_only=True)
    c = torch.load(runs["one"] / f"result-{optim}.pt", weights_only=True)
    assert c["world_size"] == 1 and c["meta"]["world_size"] == 2
    for got in (r, c):  # the loaded state is the saved one, to the bit, at 2 ranks and at 1
        assert max_diff(got["loaded"], portable["model"]) == 0.0
        assert max_diff(got["loaded_optimizer"]["state"], portable["optimizer"]["state"]) == 0.0


def test_the_shards_load_with_plain_dcp_and_as_pretrained_weights(runs):
    # docs/checkpoints.md's snippet: the model's shards read by plain torch.distributed.checkpoint code
    # (here in one process, no process group), and the shards folder given to parallelx.load_pretrained.
    import torch.distributed.checkpoint as dcp

    from parallelx.bigmodels.formats import open_weights

    step = Path(torch.load(runs["two"] / "result-adamw.pt", weights_only=True)["path"])
    portable = torch.load(runs["two"] / "portable-adamw.pt", weights_only=True)["model"]
    state = {"model": {k: torch.empty_like(v) for k, v in portable.items()}}
    dcp.load(state, checkpoint_id=str(step / "shards"), no_dist=True)
    assert max_diff(state["model"], portable) == 0.0
    weights = open_weights(step / "shards")
    assert sorted(weights.names()) == sorted(portable)  # the model's, not the optimizer's
    assert all(torch.equal(weights.rows(k), v) for k, v in portable.items())
    # The optimizer too, by torch's own state-dict functions (the FSDP2 example's --dcp-api way), keyed by name.
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    saved = torch.load(runs["two"] / "portable-adamw.pt", weights_only=True)["optimizer"]
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    model(torch.zeros(1, 8)).sum().backward()
    optimizer.step()  # torch's functions fill a state that exists
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=str(step / "shards"), no_dist=True)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    assert max_diff(dict(model.state_dict()), portable) == 0.0
    plain = {n: optimizer.state[p] for n, p in model.named_parameters()}
    assert max_diff(plain, saved["state"]) == 0.0
    assert optimizer.param_groups[0]["lr"] == saved["param_groups"][0]["lr"] != 0.5


@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_convert_and_resume_without_sharding(runs, optim, tmp_path):
    step = Path(torch.load(runs["two"] / f"result-{optim}.pt", weights_only=True)["path"])
    dst = tmp_path / "whole.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "parallelx", "convert-checkpoint", str(step.parent.parent), str(dst)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    whole = torch.load(dst, weights_only=True)
    portable = torch.load(runs["two"] / f"portable-{optim}.pt", weights_only=True)
    assert max_diff(whole["model"], portable["model"]) == 0.0
    assert sorted(whole["model"]) == ["0.bias", "0.weight", "3.bias", "3.weight"], "plain names, no wrapper's"
    assert max_diff(whole["optimizer"]["state"], portable["optimizer"]["state"]) == 0.0
    assert not whole["meta"]["sharded"] and whole["counters"]["global_step"] == 3
    # A backend that does not shard resumes the sharded checkpoint from the whole tensors: 1 process, as fsdp's C.
    backend = parallelx.get_backend("single")
    backend.init()
    run = Run(backend, optim, init_seed=99, dropout=0.0, noise=False)
    run.load(step)
    assert max_diff(run.weights(), portable["model"]) == 0.0
    run.train(2)
    c = torch.load(runs["one"] / f"result-{optim}.pt", weights_only=True)
    assert run.counters == c["counters"] and run.seen == c["seen"]
    err = max(max_diff(run.weights()[k], c["B"][k]) / float(c["B"][k].abs().max()) for k in c["B"])
    assert err <= 1e-6, f"single and fsdp at 1 rank continue the sharded checkpoint differently: {err:.2e}"
    backend.shutdown()
