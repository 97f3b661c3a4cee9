"""In-process tests: the single and dp backends, the registry, the sampler,
metrics and checkpoints."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from launching import ROOT
from torch import nn

import parallelx
from parallelx import MetricSums, ShardedSampler, real_mask
from parallelx.backend import Backend
from parallelx.errors import ParallelxError, UnknownBackendError
from parallelx.parts.collectives import LocalCollectives

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("backend", ["single", "dp"])
def test_single_process_backends_run_every_check(backend, tmp_path, monkeypatch):
    import dist_worker

    monkeypatch.setattr(sys, "argv", ["dist_worker.py", "--backend", backend, "--out", str(tmp_path)])
    assert dist_worker.main() == 0
    rep = json.loads((tmp_path / "rank0.json").read_text())
    assert rep["world_size"] == 1 and rep["name"] == backend
    assert rep["all_reduce"]["sum"] == [1.0, 0.0] and rep["all_reduce"]["mean"] == [1.0, 0.0]
    assert rep["max_rel_err_vs_single_a"] < 1e-6 and rep["max_rel_err_vs_single_b"] < 1e-6
    assert rep["optimizers_are_torch_optimizers"] and rep["lrs_b"] == rep["ref_lrs_b"]
    assert rep["ckpt_files_seen"] == ["model.pth", "state.pth"]
    assert sorted(rep["sampler"]["epoch0"]) == list(range(23))
    assert rep["sampler"]["epoch0"] != rep["sampler"]["epoch1"]
    assert rep["metrics"]["count"] == 23


def test_unknown_backend_message_lists_valid_names():
    with pytest.raises(UnknownBackendError) as err:
        parallelx.get_backend("nccl")
    for name in parallelx.available_backends():
        assert name in str(err.value)


def test_register_a_third_party_backend():
    import dataclasses

    from parallelx.backends.single import SingleStrategy

    class MyStrategy(SingleStrategy):
        spec = dataclasses.replace(SingleStrategy.spec, name="mine")

    parallelx.register_backend("mine", MyStrategy)
    try:
        assert "mine" in parallelx.available_backends()
        backend = parallelx.get_backend("mine")
        assert isinstance(backend, parallelx.Backend) and isinstance(backend.strategy, MyStrategy)
        assert backend.name == "mine" and parallelx.describe("mine").name == "mine"
    finally:
        parallelx.registry._REGISTERED.pop("mine")


@pytest.mark.parametrize(
    "env,argv,expected",
    [
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "x"}, ["t.py"], "ddp"),
        ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}, ["t.py"], "horovod"),
        (
            {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "CROSS_RANK": "0"},
            ["t.py", "--local_rank=1"],
            "deepspeed",
        ),
        ({}, ["t.py"], "single"),
    ],
)
def test_auto_detects_the_launcher(env, argv, expected):
    if expected == "single" and torch.cuda.device_count() > 1:
        expected = "dp"
    assert parallelx.detect_backend(env, argv) == expected


def test_backend_options_are_validated():
    with pytest.raises(ParallelxError, match="timeout must be a finite number of seconds > 0"):
        parallelx.get_backend("single", timeout=0)
    with pytest.raises(UnknownBackendError, match="does not accept"):
        parallelx.get_backend("single", zero_stag=2)  # no backend takes it (zero_stage is deepspeed's: ignored)
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
            b = idx[start : start + batch]
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


# ------------------------------------------------------------------ protocol
def test_a_backend_missing_a_collective_cannot_be_created():
    from parallelx.backend import Backend
    from parallelx.parts.collectives import Collectives

    class Forgetful(Collectives):  # collectives that forgot barrier and broadcast
        def reduce_(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
            return tensor

        def all_gather_list(self, tensor: torch.Tensor) -> list[torch.Tensor]:
            return [tensor]

    with pytest.raises(TypeError, match="abstract"):
        Forgetful(0, 2)

    class NoCollectives(parallelx.Strategy):  # joins a world of 2 but keeps the world-of-one collectives
        spec = parallelx.BackendSpec(name="no-collectives")

        def join(self) -> parallelx.Joined:
            return parallelx.Joined(1, 2, 1, 2, torch.device("cpu"), LocalCollectives())

        def wrap_model(self, model: nn.Module) -> nn.Module:
            return model

    with pytest.raises(parallelx.ParallelxError, match="collectives for rank 0 of 1"):
        Backend(
            NoCollectives(), parallelx.Options(environment=parallelx.launching.environments.detect_environment({}, []))
        ).init()


def test_the_facade_is_not_subclassed():
    """Backend authors write a Strategy; the facade users call is final."""
    with pytest.raises(ParallelxError, match="Strategy"):

        class Mine(Backend):  # type: ignore[misc]
            pass

    assert parallelx.get_backend("single").strategy.spec.name == "single"


def test_a_backend_name_given_to_the_facade_says_what_to_write():
    with pytest.raises(ParallelxError, match=r"parallelx.get_backend\('ddp'\)"):
        Backend("ddp")  # type: ignore[arg-type]


def test_auto_is_a_backend_name_everywhere():
    spec = parallelx.describe("auto")
    assert spec.name == parallelx.detect_backend()
    assert parallelx.get_backend("auto").name == spec.name


def test_add_arguments_and_from_args_build_every_backend():
    import argparse

    parser = argparse.ArgumentParser()
    assert parallelx.add_arguments(parser) is parser
    # The deepspeed launcher's --local_rank is accepted whichever backend runs.
    args = parser.parse_args(["--backend", "single", "--device", "cpu", "--timeout", "30", "--local_rank=1"])
    backend = parallelx.from_args(args)
    assert backend.name == "single" and backend.run.timeout_s == 30 and backend.run.device_request == "cpu"
    assert parallelx.from_args(parser.parse_args([])).name == parallelx.detect_backend()
    for bad in (["--timeout", "0"], ["--timeout", "nan"], ["--device", "tpu"], ["--backend", "mpi"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_device_override_forces_the_cpu():
    with parallelx.get_backend("single", device="cpu") as b:
        assert b.device == torch.device("cpu")
    with pytest.raises(ParallelxError, match="device must be one of"):
        parallelx.get_backend("single", device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ParallelxError, match="device 'cuda' asked for"):
            parallelx.get_backend("single", device="cuda").init()


@pytest.mark.parametrize("backend", ["single", "dp"])
def test_separate_calls_and_a_scheduler_built_afterwards(backend):
    with parallelx.get_backend(backend) as b:
        model = b.wrap_model(nn.Linear(3, 2))
        opt = b.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=1.0))
        assert isinstance(opt, torch.optim.Optimizer)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
        b.backward(model(torch.ones(1, 3)).sum())
        opt.step()
        sched.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(0.1)


def test_context_manager_releases_the_backend_when_training_raises():
    b = parallelx.get_backend("single")
    with pytest.raises(RuntimeError, match="boom"), b:
        assert b.initialized
        raise RuntimeError("boom")
    assert not b.initialized


def test_metric_sums_mask_the_padding_by_themselves():
    n, world = 23, 4
    losses = torch.arange(n, dtype=torch.float64)
    totals = []
    for r in range(world):
        s = ShardedSampler(range(n), num_replicas=world, rank=r, shuffle=True, seed=2)
        loader = torch.utils.data.DataLoader(losses, batch_size=4, sampler=s)
        for _ in range(2):  # a second pass with a fresh MetricSums, and one reused across passes
            sums = MetricSums(s)
            for batch in loader:
                sums.update(batch, batch.long() % 3 == 0)
        reused = MetricSums(s)
        for _ in range(2):
            for batch in loader:
                reused.update(batch, batch.long() % 3 == 0)
        totals.append((sums, reused))
    for idx in (0, 1):
        count = sum(int(t[idx].count) for t in totals)
        expected = n * (1 if idx == 0 else 2)
        assert count == expected
    assert sum(float(t[0].loss_sum) for t in totals) == float(losses.sum())
    s = ShardedSampler(range(5), num_replicas=2, rank=0, shuffle=False)
    sums = MetricSums(s)
    list(iter(s))
    with pytest.raises(ParallelxError, match="is the loader built on this sampler"):
        sums.update(torch.zeros(4), torch.zeros(4, dtype=torch.bool))


def test_warnings_are_printed_once_by_the_main_rank(capsys):
    from parallelx import log

    try:
        log.set_rank(1)
        log.warn("from rank one")
        log.set_rank(0)
        log.warn("from rank zero")
        log.warn("from rank zero")
    finally:
        log.set_rank(None)
    err = capsys.readouterr().err
    assert "from rank one" not in err and err.count("from rank zero") == 1


def test_deepspeed_config_that_changes_the_math_is_named(tmp_path):
    def DeepSpeedBackend(**options):
        return parallelx.get_backend("deepspeed", **options).strategy

    b = DeepSpeedBackend()
    assert b.config["gradient_clipping"] == 0.0 and b.math_changes == []
    cfg = tmp_path / "ds.json"
    cfg.write_text('{"gradient_clipping": 1.0, "bf16": {"enabled": true}}')
    b = DeepSpeedBackend(config=cfg)
    assert b.config["gradient_clipping"] == 1.0  # honoured
    assert b.math_changes == ["gradient_clipping=1.0", "bf16.enabled=true"]
    cfg.write_text("[1, 2]")
    with pytest.raises(ParallelxError, match="must hold a JSON object"):
        DeepSpeedBackend(config=cfg)


def test_readme_table_is_the_launchers_own():
    from parallelx.registry import markdown_table

    readme = (ROOT / "README.md").read_text()
    begin, end = "<!-- launchers:begin -->\n", "<!-- launchers:end -->"
    assert begin in readme, "README lost its generated launcher table"
    table = readme.split(begin, 1)[1].split(end, 1)[0]
    assert table == markdown_table("recipes.dogcat"), "regenerate it with `python -m parallelx launchers`"


def test_no_backend_name_branches_outside_backends():
    import re

    pattern = re.compile(r"""(==|!=|in)\s*\(?\s*["'](ddp|horovod|deepspeed|dp|single)["']""")
    offenders = []
    for folder in ("parallelx", "recipes", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            for no, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{no}: {line.strip()}")
    assert not offenders, "backend knowledge belongs in backends/:\n" + "\n".join(offenders)


def test_is_main_means_rank_0_as_a_property_and_as_a_call():
    """`if backend.is_main:` was always true (a bound method): every rank printed."""
    from threads import in_threads

    seen = in_threads(2, lambda b: (bool(b.is_main), b.is_main(), b.is_main == (b.rank == 0), bool(b.is_local_main)))
    assert seen == [(True, True, True, True), (False, False, True, False)]
    with parallelx.get_backend("single", device="cpu") as backend:
        assert backend.is_main and backend.is_main() and backend.is_local_main()


def test_batches_have_the_loaders_length():
    """A progress bar or a logger sizes itself from len(backend.batches(loader))."""
    from torch.utils.data import DataLoader

    loader = DataLoader(list(range(10)), batch_size=3)
    with parallelx.get_backend("single", device="cpu") as backend:
        batches = backend.batches(loader)
        assert len(batches) == 4 and len(list(batches)) == 4
        assert len(backend.batches(loader, limit=2)) == 2 and len(list(backend.batches(loader, limit=2))) == 2
        unsized = backend.batches(b for b in loader)
        with pytest.raises(TypeError, match="no length"):
            len(unsized)
        assert len(list(unsized)) == 4
