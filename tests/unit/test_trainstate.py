"""Training-state checkpoints in one process: exact resume, the files, crashes,
damaged and mismatched checkpoints, pruning, and the sampler's position
across world sizes (ranks simulated with ShardedSampler(num_replicas, rank))."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from trainstate_worker import DATASET_SIZE, Run, max_diff

import parallelx
from parallelx import MetricSums, ParallelxError, ShardedSampler
from parallelx.checkpoints.trainstate import latest_checkpoint, load_training_state, save_training_state

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def backend():
    with parallelx.get_backend("single") as b:
        yield b


def _continued(backend, optim: str, tmp_path: Path, save_at: int, more: int):
    a = Run(backend, optim)
    a.train(save_at)
    path = a.save(tmp_path)
    a.mark = len(a.seen)
    a.train(more)
    after_a = (random.random(), float(np.random.rand()), torch.rand(3))
    b = Run(backend, optim, init_seed=99)
    info = b.load(path)
    b.train(more)
    after_b = (random.random(), float(np.random.rand()), torch.rand(3))
    return a, b, after_a, after_b, info, path


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("save_at", [3, 8])  # mid-epoch, and at the end of one (8 batches per epoch)
def test_resume_is_bitwise_exact(backend, tmp_path, optim, save_at):
    a, b, after_a, after_b, info, path = _continued(backend, optim, tmp_path, save_at, 5)
    wa, wb = a.weights(), b.weights()
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "weights differ after resuming"
    assert after_a[:2] == after_b[:2] and torch.equal(after_a[2], after_b[2]), "RNG did not continue identically"
    assert a.seen[a.mark :] == b.seen, "the resumed run trained on other samples"
    assert a.counters == b.counters and info["counters"]["global_step"] == save_at
    assert a.scheduler.state_dict() == b.scheduler.state_dict()
    assert info["loader_seed"] == 1 and info["meta"]["backend"] == "single" and info["meta"]["world_size"] == 1


def test_every_file_loads_weights_only(backend, tmp_path):
    a = Run(backend, "adamw")
    a.train(3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    path = save_training_state(
        backend,
        tmp_path,
        step=3,
        model=a.model,
        optimizer=a.optimizer,
        scheduler=a.scheduler,
        scaler=scaler,
        sampler=a.sampler,
        counters=a.counters,
    )
    assert path == tmp_path / "checkpoints" / "step-00000003"
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-00000003"
    files = sorted(p.name for p in path.iterdir())
    assert files == ["rng-rank0.pt", "state.pt"]
    for f in path.iterdir():
        torch.load(f, weights_only=True)
    state = torch.load(path / "state.pt", weights_only=True)
    opt = state["optimizer"]
    names = [n for n, _ in a.model.named_parameters()]
    assert list(opt["state"]) == names and opt["param_groups"][0]["params"] == names
    assert set(opt["state"]["0.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert state["sampler"] == {"seed": 1, "epoch": 0, "consumed": 9, "dataset_size": DATASET_SIZE, "shuffle": True}
    assert state["meta"]["optimizer"] == "AdamW" and state["meta"]["format"] == 1
    other = torch.amp.GradScaler("cpu", init_scale=4.0)
    b = Run(backend, "adamw")
    load_training_state(backend, path, model=b.model, optimizer=b.optimizer, scaler=other)
    assert other.state_dict() == scaler.state_dict()


def test_keep_prunes_oldest_after_the_new_one_is_complete(backend, tmp_path):
    a = Run(backend, "sgd")
    for step in range(1, 6):
        a.train(1)
        a.save(tmp_path, keep=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000004", "step-00000005"]
    assert latest_checkpoint(tmp_path) == root / "step-00000005"
    assert latest_checkpoint(tmp_path / "nothing-here") is None
    a.save(tmp_path, keep=2)  # the same step again: replaced whole
    assert latest_checkpoint(tmp_path) == root / "step-00000005"


def test_leftovers_of_a_crashed_write_are_ignored(backend, tmp_path):
    a = Run(backend, "sgd")
    a.train(2)
    good = a.save(tmp_path)
    root = tmp_path / "checkpoints"
    # A write that died half-way: a hidden directory with a truncated state.
    torn = root / ".tmp-step-00000009-abc"
    torn.mkdir()
    (torn / "state.pt").write_bytes((good / "state.pt").read_bytes()[:100])
    assert latest_checkpoint(tmp_path) == good
    (root / "latest").unlink()  # even without the pointer, only complete ones count
    assert latest_checkpoint(tmp_path) == good
    a.train(1)
    a.save(tmp_path)
    assert not torn.exists(), "leftovers are removed after the next complete save"


def test_a_failure_after_the_publish_is_a_warning_and_the_newest_complete_one_is_taken(
    backend, tmp_path, monkeypatch, capsys
):
    """Once a checkpoint is complete (renamed into place, or its commit record written), `latest` and the
    retention cannot make it less so: their failure (a store gone right after the commit) is a warning,
    the save succeeds, and ``latest_checkpoint`` takes the newest complete checkpoint over a stale
    ``latest``."""
    from parallelx.checkpoints import trainstate

    a = Run(backend, "sgd")
    a.train(1)
    first = a.save(tmp_path)
    write_latest = trainstate._write_latest

    def gone(root, name):  # type: ignore[no-untyped-def]
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(trainstate, "_write_latest", gone)
    a.train(1)
    second = a.save(tmp_path)
    err = capsys.readouterr().err
    assert "step-00000002 is complete, but updating `latest` or removing older checkpoints failed" in err, err
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == first.name  # stale
    assert latest_checkpoint(tmp_path) == second
    assert "is newer and complete; taking it" in capsys.readouterr().err
    monkeypatch.setattr(trainstate, "_write_latest", write_latest)


def _one_line_error(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, f"not one line: {msg!r}"
    return msg


def test_damaged_checkpoints_fail_with_one_line(backend, tmp_path):
    a = Run(backend, "sgd")
    a.train(2)
    path = a.save(tmp_path)
    state = path / "state.pt"
    data = state.read_bytes()
    state.write_bytes(data[: len(data) // 2])
    with pytest.raises(ParallelxError) as exc:
        Run(backend, "sgd").load(path)
    assert "cannot be read" in _one_line_error(exc)
    state.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ParallelxError) as exc:
        Run(backend, "sgd").load(path)
    _one_line_error(exc)
    state.write_bytes(data)
    (path / "rng-rank0.pt").write_bytes(b"\0" * 10)
    with pytest.raises(ParallelxError) as exc:
        Run(backend, "sgd").load(path)
    assert "rng-rank0.pt" in _one_line_error(exc)
    with pytest.raises(ParallelxError) as exc:
        Run(backend, "sgd").load(tmp_path)
    assert "latest_checkpoint" in _one_line_error(exc)


def test_a_full_disk_is_named_and_leaves_the_last_checkpoint(backend, tmp_path, monkeypatch):
    """torch reports a disk that filled mid-write as `unexpected pos N vs M`; the error adds the
    disk's free space, and the last complete checkpoint stays the latest."""
    import shutil

    from parallelx.parts import portable

    a = Run(backend, "sgd")
    a.train(2)
    good = a.save(tmp_path)
    full = RuntimeError("[enforce fail at inline_container.cc:671] . unexpected pos 469923264 vs 469923152")

    def disk_full(obj, f, *args, **kwargs):  # type: ignore[no-untyped-def]
        f.write(b"\0" * 64)
        raise full

    monkeypatch.setattr(torch, "save", disk_full)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=12 << 20))
    a.train(1)
    with pytest.raises(ParallelxError) as exc:
        a.save(tmp_path)
    msg = _one_line_error(exc)
    assert "unexpected pos" in msg and "has 12 MiB free: a full disk is the likely cause" in msg, msg
    assert latest_checkpoint(tmp_path) == good
    with pytest.raises(ParallelxError) as exc:
        backend.save(a.model, tmp_path / "model.pt")
    assert "has 12 MiB free" in _one_line_error(exc) and not (tmp_path / "model.pt").exists()
    # Plenty of room: the error is the engine's alone, no guess about the disk.
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=50 << 30))
    assert "free" not in portable.write_failure(tmp_path / "x.pt", full)
    assert "a full disk" in portable.write_failure(tmp_path / "x.pt", OSError(28, "No space left on device"))


def test_other_model_or_optimizer_fails_with_one_line(backend, tmp_path):
    a = Run(backend, "sgd")
    a.train(2)
    path = a.save(tmp_path)
    with pytest.raises(ParallelxError) as exc:
        Run(backend, "sgd", hidden=12).load(path)  # same names, other shapes
    assert "does not fit this model" in _one_line_error(exc)
    other = nn.Sequential(nn.Linear(8, 4))
    with pytest.raises(ParallelxError) as exc:
        load_training_state(backend, path, model=other, optimizer=torch.optim.SGD(other.parameters(), lr=0.1))
    assert "another model" in _one_line_error(exc)
    with pytest.raises(ParallelxError) as exc:
        Run(backend, "adamw").load(path)
    assert "SGD" in _one_line_error(exc) and "AdamW" in str(exc.value)


def test_bad_arguments(backend, tmp_path):
    a = Run(backend, "sgd")
    with pytest.raises(ParallelxError, match="counters"):
        save_training_state(backend, tmp_path, step=1, model=a.model, optimizer=a.optimizer, counters={"epoch": 1.5})
    with pytest.raises(ParallelxError, match="keep"):
        save_training_state(backend, tmp_path, step=1, model=a.model, optimizer=a.optimizer, counters={}, keep=0)
    with pytest.raises(ParallelxError) as exc:  # a function in the state: not storable
        save_training_state(
            backend,
            tmp_path,
            step=1,
            model=a.model,
            optimizer=a.optimizer,
            counters={},
            scheduler=type("S", (), {"state_dict": lambda self: {"f": print}})(),
        )
    assert "weights_only" in _one_line_error(exc)
    assert latest_checkpoint(tmp_path) is None and not list((tmp_path / "checkpoints").iterdir())


# ----------------------------------------------------------------- sampler
def _consume(samplers: list[ShardedSampler], per_rank: int) -> tuple[list[int], list]:
    """Every rank draws ``per_rank`` indices of a new pass; returns them and the iterators."""
    its = [iter(s) for s in samplers]
    return [next(it) for it in its for _ in range(per_rank)], its


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2), (2, 2), (3, 2), (2, 4)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_sampler_resumes_across_world_sizes(before, after, shuffle):
    n, per_rank = DATASET_SIZE, 4
    old = [ShardedSampler(range(n), num_replicas=before, rank=r, shuffle=shuffle, seed=3) for r in range(before)]
    old[0].set_epoch(2)
    for s in old[1:]:
        s.set_epoch(2)
    done, _ = _consume(old, per_rank)
    state = old[0].state_dict()
    assert state["epoch"] == 2 and state["consumed"] == per_rank * before
    new = [ShardedSampler(range(n), num_replicas=after, rank=r, shuffle=shuffle, seed=0) for r in range(after)]
    rest, lengths = [], set()
    for s in new:
        s.load_state_dict(state)
        lengths.add(len(s))
        shard, sums = list(s), MetricSums(s)
        assert len(shard) in lengths
        rest += shard[: s.num_real]
        assert not s.real_mask(0, len(s))[s.num_real :].any()
        sums.update(torch.zeros(len(shard)), torch.ones(len(shard), dtype=torch.bool))
        assert sums.compute()["count"] == s.num_real
    assert len(lengths) == 1, "ranks must get equal lengths"
    assert sorted(done + rest) == list(range(n)), "every sample of the interrupted epoch exactly once"
    for s in new:  # the pass after is a whole epoch again
        assert s.state_dict()["epoch"] == 3 and len(list(s)) == len(s) == -(-n // after)
        assert s.num_real == len(range(s.rank, n, after))


def test_sampler_resume_at_same_world_size_repeats_the_uninterrupted_pass():
    n, w = DATASET_SIZE, 2
    full = [list(ShardedSampler(range(n), num_replicas=w, rank=r, seed=4)) for r in range(w)]
    old = [ShardedSampler(range(n), num_replicas=w, rank=r, seed=4) for r in range(w)]
    _consume(old, 5)
    for r in range(w):
        s = ShardedSampler(range(n), num_replicas=w, rank=r, seed=4)
        s.load_state_dict(old[0].state_dict())
        assert list(s) == full[r][5:]


def test_sampler_state_edge_cases():
    s = ShardedSampler(range(10), num_replicas=2, rank=0, seed=1)
    assert s.state_dict() == {"seed": 1, "epoch": 0, "consumed": 0, "dataset_size": 10, "shuffle": True}
    list(s)  # a whole pass: the state is the start of the next epoch
    assert s.state_dict()["epoch"] == 1 and s.state_dict()["consumed"] == 0
    it = iter(s)
    next(it), next(it), next(it)  # drawn ahead of training (a prefetching loader)
    assert s.state_dict(consumed=1)["consumed"] == 2 and s.state_dict()["consumed"] == 6
    with pytest.raises(ParallelxError):
        s.state_dict(consumed=6)
    t = ShardedSampler(range(10), num_replicas=1, seed=1)
    t.load_state_dict(s.state_dict(consumed=1))
    assert t.state_dict()["consumed"] == 2, "loaded but not iterated: the state is unchanged"
    with pytest.raises(ParallelxError, match="dataset of 10"):
        ShardedSampler(range(11), seed=1).load_state_dict(s.state_dict())
    t.set_epoch(5)  # another epoch than the one being resumed: taken whole
    assert len(list(t)) == 10


def test_named_optimizer_state_round_trip(backend):
    a = Run(backend, "sgd")
    a.train(2)
    named = backend.named_optimizer_state(a.model, a.optimizer)
    b = Run(backend, "sgd", init_seed=5)
    backend.load_named_optimizer_state(b.model, b.optimizer, named)
    assert max_diff(b.optimizer.state_dict(), a.optimizer.state_dict()) == 0.0


def test_sampler_length_after_a_resumed_pass_is_the_next_whole_pass():
    s = ShardedSampler(range(10), num_replicas=2, rank=0, seed=1)
    s.load_state_dict({"seed": 1, "epoch": 0, "consumed": 6, "dataset_size": 10, "shuffle": True})
    assert len(s) == 2
    it = iter(s)
    next(it)
    assert len(s) == 2 and s.num_real == 2
    next(it)
    assert len(s) == 5, "a loader asks len() before its next pass begins"
    assert len(list(s)) == 5 and s.num_real == 5


@pytest.mark.parametrize("holder", ["zero", "fp16_optimizer"])
def test_deepspeed_fp16_loss_scale_survives_a_checkpoint(holder, tmp_path, monkeypatch):
    """DeepSpeed's fp16 engine (16-mixed, GPUs only) keeps its running loss
    scale inside its optimizer: the ZeRO optimizers in a ``DynamicLossScaler``,
    ZeRO 0's FP16_Optimizer in a ``LossScaleConfig``.  With DeepSpeed's own
    classes: after overflows and a growth, the saved scale (plain numbers, read
    back with weights_only) restored into a fresh one continues identically."""
    pytest.importorskip("deepspeed")
    from types import SimpleNamespace

    import deepspeed.runtime.fp16.loss_scaler as ds_scaler
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaleConfig

    from parallelx.backends import _deepspeed_zero as zero_state

    # Its overflow messages ask deepspeed.comm for the rank, which wants a process group.
    monkeypatch.setattr(ds_scaler.dist, "get_rank", lambda *args, **kwargs: 0)
    monkeypatch.setattr(ds_scaler, "log_dist", lambda *args, **kwargs: None)

    def fresh() -> SimpleNamespace:
        if holder == "zero":
            return SimpleNamespace(
                loss_scaler=DynamicLossScaler(
                    init_scale=2.0**16, scale_window=3, min_scale=1.0, delayed_shift=2, consecutive_hysteresis=False
                )
            )
        return SimpleNamespace(loss_scale_config=LossScaleConfig(torch.float16, True, 0, None))

    def update(opt: SimpleNamespace, overflow: bool) -> None:
        if holder == "zero":
            opt.loss_scaler.update_scale(overflow)
        else:  # what FP16_Optimizer._update_scale does with its config
            c = opt.loss_scale_config
            if overflow:
                c.cur_scale, c.last_overflow_iter = max(c.cur_scale / c.scale_factor, c.min_loss_scale), c.cur_iter
            elif (c.cur_iter - c.last_overflow_iter - 1) > 0 and (c.cur_iter - c.last_overflow_iter - 1) % 2 == 0:
                c.cur_scale *= c.scale_factor
            c.cur_iter += 1

    def observed(opt: SimpleNamespace) -> tuple:
        h = opt.loss_scaler if holder == "zero" else opt.loss_scale_config
        return tuple(getattr(h, f, None) for f in zero_state.LOSS_SCALE_FIELDS)

    history = [True, True, False, True, False, False, False, False]
    a = fresh()
    for overflow in history[:5]:
        update(a, overflow)
    state = zero_state.loss_scale_state(a)
    assert state is not None and state["cur_scale"] != fresh_scale(fresh()), state
    torch.save(state, tmp_path / "scale.pt")
    b = fresh()
    zero_state.load_loss_scale_state(b, torch.load(tmp_path / "scale.pt", weights_only=True))
    assert observed(b) == observed(a)
    for overflow in history[5:]:
        update(a, overflow)
        update(b, overflow)
        assert observed(b) == observed(a)
    # fp32 / bf16 (no scaling) save nothing; loading nothing keeps the initial scale.
    assert zero_state.loss_scale_state(SimpleNamespace()) is None
    c = fresh()
    zero_state.load_loss_scale_state(c, None)
    assert observed(c) == observed(fresh())


def fresh_scale(opt) -> float:
    h = getattr(opt, "loss_scaler", None) or opt.loss_scale_config
    return float(h.cur_scale)
