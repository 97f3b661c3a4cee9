"""Hybrid sharding (HSDP: ``--fsdp-replicate``) at 4 processes under torchrun, 2 groups of 2,
against ddp at 4 (``tests/support/hsdp_worker.py``; four launches, a scenario).

The same weights and the same reported gradient norm as ddp, within the order of float
additions; fsdp sharding over all 4 ranks gives the noise floor printed beside each
difference.  A sharded checkpoint resumes bitwise on the same mesh and loads, to the bit, on
another mesh and world size (plain fsdp at 2).  ``save_pretrained`` writes the trained
weights once (the first group writes, the others skip their copies).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from launching import launch, require_launcher
from trainstate_worker import max_diff

pytestmark = [pytest.mark.launcher, pytest.mark.scenario, pytest.mark.timeout(900)]
OPTIMIZERS = ("sgd", "adamw")
# Only the order of float additions differs (reduce-scatter then all-reduce against one all-reduce).
REL_TOL = 1e-6
WORKER = "tests/support/hsdp_worker.py"


def rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).norm() / max(float(b[k].double().norm()), 1e-12)) for k in b)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    require_launcher("torchrun")
    out = {name: tmp_path_factory.mktemp(f"hsdp-{name}") for name in ("hsdp", "ddp", "fsdp", "another")}
    jobs = {
        "hsdp": (["--backend", "fsdp", "--replicate", "2"], 4),
        "ddp": (["--backend", "ddp"], 4),
        "fsdp": (["--backend", "fsdp", "--replicate", "1"], 4),
        "another": (["--backend", "fsdp", "--replicate", "1", "--load-from", str(out["hsdp"])], 2),
    }
    for name, (extra, nproc) in jobs.items():
        res = launch("torchrun", [WORKER, *extra, "--out", str(out[name])], nproc=nproc, timeout=300)
        assert res.returncode == 0, f"{name}:\n{res.tail(60)}"
    return out


def result(runs: dict[str, Path], name: str, optim: str) -> dict:
    return torch.load(runs[name] / f"result-{optim}.pt", weights_only=True)


def test_the_mesh_is_two_groups_each_sharded_over_two(runs):
    mesh = json.loads((runs["hsdp"] / "mesh.json").read_text())
    assert mesh == {"shape": [2, 2], "names": ["replicate", "shard"]}
    assert json.loads((runs["fsdp"] / "mesh.json").read_text())["shape"] == [4]
    r = result(runs, "hsdp", "sgd")
    # Linear(8, 16) and Linear(16, 4): each rank holds half of each weight's rows (sharded over 2, not 4).
    assert r["local_rows"] == [rows[0] // 2 for rows in r["rows"]]


@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_hsdp_trains_ddps_weights_and_reports_its_norm(runs, optim):
    ddp = result(runs, "ddp", optim)
    hsdp, flat = result(runs, "hsdp", optim), result(runs, "fsdp", optim)
    err, floor = rel(hsdp["A"], ddp["A"]), rel(flat["A"], ddp["A"])
    norm_err = abs(hsdp["norm"] - ddp["norm"]) / ddp["norm"]
    norm_floor = abs(flat["norm"] - ddp["norm"]) / ddp["norm"]
    print(f"{optim}: hsdp vs ddp {err:.2e} (fsdp vs ddp {floor:.2e}); norm {norm_err:.2e} (fsdp {norm_floor:.2e})")
    assert err < REL_TOL and floor < REL_TOL
    # Each group holds every shard: a sum of squares over the world would count each twice (x sqrt 2).
    assert norm_err < REL_TOL, (hsdp["norm"], ddp["norm"])


@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_a_sharded_checkpoint_resumes_bitwise_and_loads_on_another_mesh(runs, optim):
    hsdp = result(runs, "hsdp", optim)
    assert max_diff(hsdp["A"], hsdp["B"]) == 0.0, "resuming on the same mesh differs from the uninterrupted run"
    other = result(runs, "another", optim)
    assert other["world_size"] == 2 and other["meta"]["world_size"] == 4
    assert max_diff(other["loaded"], hsdp["portable"]["model"]) == 0.0
    assert max_diff(other["loaded_optimizer"]["state"], hsdp["portable"]["optimizer"]["state"]) == 0.0


@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_save_pretrained_writes_the_weights_once(runs, optim):
    from safetensors import safe_open

    for name in ("hsdp", "ddp"):
        folder = runs[name] / f"weights-{optim}"
        assert sorted(p.name for p in folder.iterdir() if p.suffix == ".safetensors") == ["model.safetensors"]
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            saved = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no mapping)
        assert max_diff(saved, result(runs, name, optim)["A"]) == 0.0, name
