"""In-process tests: the single and dp backends, the registry, the sampler,
metrics and checkpoints."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from launching import ROOT
from torch import nn

import parallelx
from parallelx import MetricSums, ShardedSampler, real_mask
from parallelx.errors import ParallelxError, UnknownBackendError

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("backend", ["single", "dp"])
def test_single_process_backends_run_every_check(backend, tmp_path, monkeypatch):
    import dist_worker

    monkeypatch.setattr(sys, "argv", ["dist_worker.py", "--backend", backend, "--out", str(tmp_path)])
    assert dist_worker.main() == 0
    rep = json.loads((tmp_path / "rank0.json").read_text())
    assert rep["world_size"] == 1 and rep["name"] == backend
    assert rep["all_reduce"]["sum"] == [1.0, 0.0] and rep["all_reduce"]["mean"] == [1.0, 0.0]
    assert rep["max_rel_err_vs_single"] < 1e-6
    assert rep["ckpt_files_seen"] == ["model.pth", "state.pth"]
    assert sorted(rep["sampler"]["epoch0"]) == list(range(23))
    assert rep["sampler"]["epoch0"] != rep["sampler"]["epoch1"]
    assert rep["metrics"]["count"] == 23


def test_import_parallelx_imports_no_heavy_backend_package():
    code = ("import sys, parallelx, backends.horovod, backends.deepspeed, parallelx.registry as r\n"
            "r.available_backends(); r.detect_backend({}, [])\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('horovod', 'deepspeed')]\n"
            "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_unknown_backend_message_lists_valid_names():
    with pytest.raises(UnknownBackendError) as err:
        parallelx.get_backend("nccl")
    for name in parallelx.available_backends():
        assert name in str(err.value)


def test_register_a_third_party_backend():
    from backends.single import SingleBackend

    class MyBackend(SingleBackend):
        name = "mine"

    parallelx.register_backend("mine", MyBackend)
    try:
        assert "mine" in parallelx.available_backends()
        assert isinstance(parallelx.get_backend("mine"), MyBackend)
    finally:
        parallelx.registry._REGISTERED.pop("mine")


@pytest.mark.parametrize("env,argv,expected", [
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "x"}, ["t.py"], "ddp"),
    ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}, ["t.py"], "horovod"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "CROSS_RANK": "0"}, ["t.py", "--local_rank=1"], "deepspeed"),
    ({}, ["t.py"], "single"),
])
def test_auto_detects_the_launcher(env, argv, expected):
    if expected == "single" and torch.cuda.device_count() > 1:
        expected = "dp"
    assert parallelx.detect_backend(env, argv) == expected


def test_backend_options_are_validated():
    with pytest.raises(ParallelxError, match="timeout must be > 0"):
        parallelx.get_backend("single", timeout=0)
    with pytest.raises(UnknownBackendError, match="does not accept"):
        parallelx.get_backend("single", zero_stage=2)
    with pytest.raises(ParallelxError, match="zero_stage must be 0, 1, 2 or 3"):
        parallelx.get_backend("deepspeed", zero_stage=4)
    b = parallelx.get_backend("single")
    with pytest.raises(ParallelxError, match="call backend.init"):
        b.setup(nn.Linear(2, 2))
    b.init()
    with pytest.raises(ParallelxError, match="unknown reduce op"):
        b.all_reduce(torch.ones(1), op="avg")


@pytest.mark.parametrize("n", [1, 5, 23, 64])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [True, False])
def test_sampler_real_samples_partition_the_dataset(n, world, shuffle):
    samplers = [ShardedSampler(range(n), num_replicas=world, rank=r, shuffle=shuffle, seed=3) for r in range(world)]
    shards = [list(iter(s)) for s in samplers]
    assert len({len(s) for s in shards}) == 1 and len(shards[0]) == math.ceil(n / world)
    real = [i for s, sh in zip(samplers, shards) for i in sh[: s.num_real]]
    assert sorted(real) == list(range(n))
    assert sum(s.num_real for s in samplers) == n


def test_sampler_epochs_change_without_set_epoch_and_set_epoch_is_honoured():
    s = ShardedSampler(range(50), num_replicas=2, rank=0, seed=0)
    e0, e1 = list(iter(s)), list(iter(s))
    assert e0 != e1
    s.set_epoch(0)
    assert list(iter(s)) == e0  # set_epoch wins, then counting resumes
    assert list(iter(s)) == e1


def test_sampler_drop_last_and_bad_input():
    s = ShardedSampler(range(23), num_replicas=2, rank=1, drop_last=True, shuffle=False)
    assert len(s) == 11 and s.num_real == 11
    with pytest.raises(ParallelxError, match="empty dataset"):
        ShardedSampler([], num_replicas=2, rank=0)
    with pytest.raises(ParallelxError, match="rank must be in"):
        ShardedSampler(range(4), num_replicas=2, rank=2)


def test_metric_sums_equal_one_process_over_the_whole_set():
    torch.manual_seed(0)
    n, world, batch = 37, 4, 6
    losses = torch.rand(n)
    correct = torch.rand(n) > 0.5
    total = MetricSums()
    total.update(losses, correct)
    parts = []
    for r in range(world):
        s = ShardedSampler(range(n), num_replicas=world, rank=r, shuffle=True, seed=1)
        idx = torch.tensor(list(iter(s)))
        m = MetricSums()
        for start in range(0, len(idx), batch):
            b = idx[start:start + batch]
            m.update(losses[b], correct[b], real_mask(s, start, len(b)))
        parts.append(m)
    loss_sum = sum(float(p.loss_sum) for p in parts)
    assert sum(int(p.count) for p in parts) == n
    assert sum(int(p.correct) for p in parts) == int(total.correct)
    assert loss_sum == pytest.approx(float(total.loss_sum), rel=1e-12)


def test_save_is_atomic_and_failure_keeps_the_old_file(tmp_path):
    b = parallelx.get_backend("single")
    b.init()
    model = b.wrap_model(nn.Linear(3, 2))
    path = tmp_path / "m.pth"
    b.save({"model": model, "epoch": 1}, path)
    before = path.read_bytes()
    with pytest.raises(ParallelxError, match="saving .* failed"):
        b.save({"model": model, "bad": lambda: 0}, path)  # lambdas do not pickle
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.pth"], "no temporary file left behind"
    loaded = b.load(path)
    assert loaded["epoch"] == 1 and set(loaded["model"]) == {"weight", "bias"}
    with pytest.raises(ParallelxError, match="does not exist"):
        b.load(tmp_path / "missing.pth")


def test_env_report_lists_every_backend():
    proc = subprocess.run([sys.executable, "-m", "parallelx", "env"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"torch       {torch.__version__}" in proc.stdout
    for name in ("single", "dp", "ddp", "horovod", "deepspeed"):
        assert any(line.split()[1:2] == [name] for line in proc.stdout.splitlines() if "]" in line), name
