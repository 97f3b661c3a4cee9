"""Checkpoints written in the background (``asynchronous=True``, ``--checkpoint-async``), in one
process and with thread-ranks: the staged copy is what is written whatever the training does
meanwhile, nothing reads a checkpoint before it is complete, a failure on one rank is raised
on every rank at the same step, and a resume from such a checkpoint is the synchronous one's.
The launcher and store runs are in tests/system/test_resume.py and test_object_store.py."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from threads import in_threads
from trainstate_worker import Run

import parallelx
from parallelx import ParallelxError
from parallelx.checkpoints import background, trainstate
from parallelx.checkpoints.trainstate import is_complete, latest_checkpoint


@pytest.fixture
def backend():
    with parallelx.get_backend("single") as b:
        yield b


def _held_writes(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Every checkpoint file write waits until the returned event is set (a slow disk)."""
    go = threading.Event()
    write = trainstate._write

    def slow(obj, path):  # type: ignore[no-untyped-def]
        assert go.wait(30), "the test never released the write"
        write(obj, path)

    monkeypatch.setattr(trainstate, "_write", slow)
    return go


def test_the_staged_copy_is_written_whatever_the_training_does_meanwhile(backend, tmp_path, monkeypatch):
    run = Run(backend, "adamw")
    run.train(2)
    first = run.save(tmp_path)  # synchronous: the previous complete checkpoint
    run.train(1)
    at_save = {k: v.clone() for k, v in run.weights().items()}
    moments = {k: v.clone() for k, v in run.optimizer.state_dict()["state"][0].items() if torch.is_tensor(v)}
    norm_sum = torch.tensor(1.5)  # a loop's own value, updated in place at each step (as the recipes' is)
    go = _held_writes(monkeypatch)
    path = run.save(tmp_path, asynchronous=True, extra={"norm_sum": norm_sum})
    assert path == tmp_path / "checkpoints" / "step-00000003"
    # The save returned while its files wait: the training goes on and changes every weight.
    run.train(3)
    norm_sum += 2.0
    assert any(not torch.equal(at_save[k], v) for k, v in run.weights().items())
    assert background.pending(backend) is not None
    assert latest_checkpoint(tmp_path) == first and not is_complete(path), "an unfinished checkpoint was taken"
    go.set()
    parallelx.wait_for_checkpoint(backend)
    assert background.pending(backend) is None
    assert latest_checkpoint(tmp_path) == path
    state = torch.load(path / "state.pt", weights_only=True)
    assert all(torch.equal(state["model"][k], at_save[k]) for k in at_save), "a later update reached the file"
    saved = state["optimizer"]["state"][next(iter(state["optimizer"]["state"]))]
    assert all(torch.equal(saved[k], moments[k]) for k in moments), "a later update reached the optimizer state"
    assert state["counters"]["global_step"] == 3
    assert float(state["extra"]["norm_sum"]) == 1.5, "a later in-place update reached the loop's value"


def test_a_save_waits_for_the_one_in_flight(backend, tmp_path, monkeypatch):
    run = Run(backend, "sgd")
    run.train(1)
    go = _held_writes(monkeypatch)
    first = run.save(tmp_path, asynchronous=True)
    run.train(1)
    threading.Timer(0.5, go.set).start()  # the second save must block until the first is complete
    second = run.save(tmp_path, asynchronous=True)
    assert is_complete(first)
    parallelx.wait_for_checkpoint(backend)
    assert latest_checkpoint(tmp_path) == second and is_complete(second)


def test_resuming_from_a_background_checkpoint_is_the_synchronous_resume(backend, tmp_path):
    a = Run(backend, "adamw")
    a.train(3)
    sync = a.save(tmp_path / "sync")
    asynchronous = a.save(tmp_path / "async", asynchronous=True)
    parallelx.wait_for_checkpoint(backend)
    finals = []
    for path in (sync, asynchronous):
        b = Run(backend, "adamw", init_seed=7)
        b.load(path)
        b.train(4)
        finals.append(b.weights())
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])


def test_the_checkpointer_in_the_background_ends_complete(backend, tmp_path):
    run = Run(backend, "sgd")
    ckpt = parallelx.Checkpointer(
        backend, tmp_path, every=2, keep=2, asynchronous=True, model=run.model, optimizer=run.optimizer
    )
    with ckpt:
        for _ in range(5):
            run.train(1)
            ckpt.step()
    # The with block's end waited for the last one: complete, and the oldest pruned.
    assert background.pending(backend) is None
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-00000004"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "latest",
        "step-00000002",
        "step-00000004",
    ]


def test_a_failed_background_write_is_raised_on_every_rank_at_the_same_step(tmp_path, monkeypatch):
    """Rank 1's file write fails; both ranks go on stepping (each step's preemption all-reduce
    carries the flags) and both raise the same error at the same step, naming the checkpoint,
    the rank and the cause; the previous complete checkpoint stays the latest."""
    write = trainstate._write

    def failing(obj, path):  # type: ignore[no-untyped-def]
        if "step-00000002" in str(path) and path.name == "rng-rank1.pt":
            raise OSError(28, "No space left on device")
        write(obj, path)

    monkeypatch.setattr(trainstate, "_write", failing)

    def body(backend: parallelx.Backend) -> tuple[int, str]:
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = backend.setup(model, optimizer)
        common = dict(model=model, optimizer=optimizer, counters={})
        parallelx.save_training_state(backend, tmp_path, step=1, **common)
        parallelx.save_training_state(backend, tmp_path, step=2, asynchronous=True, **common)
        for step in range(1, 200):
            try:
                background.poll(backend, [0])  # what Checkpointer.step runs each step
            except ParallelxError as exc:
                return step, str(exc)
            backend.barrier()  # a training step's own collective
        return -1, "never raised"

    raised = in_threads(2, body)
    assert raised[0] == raised[1], raised  # the same step, the same words
    step, text = raised[0]
    assert step > 0 and "\n" not in text
    assert "step-00000002" in text and "rank 1" in text and "No space left on device" in text, text
    assert latest_checkpoint(tmp_path) == Path(tmp_path) / "checkpoints" / "step-00000001"


def test_the_backends_shutdown_completes_a_save_in_flight(tmp_path, monkeypatch):
    """A script that saves in the background and ends (``with backend:``) without waiting: the
    checkpoint is complete once the backend is shut down."""
    go = _held_writes(monkeypatch)
    with parallelx.get_backend("single") as backend:
        run = Run(backend, "sgd")
        run.train(1)
        path = run.save(tmp_path, asynchronous=True)
        threading.Timer(0.3, go.set).start()
    assert latest_checkpoint(tmp_path) == path and is_complete(path)


def test_fsdp_sharded_async_save_writes_the_copies_while_the_training_goes_on(tmp_path, monkeypatch):
    """fsdp's shards (DTensors), a world of one in this process: the save returns once each local shard is
    copied; DCP writes the copies on the writer thread, after the training has changed every weight and
    moment.  (ZeRO's runs, and two ranks: tests/launcher/test_zero_shards.py.)"""
    from parallelx.checkpoints import sharded

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # the world of one sets them
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    with parallelx.get_backend("fsdp", sharded_checkpoints=True) as backend:
        run = Run(backend, "adamw")
        run.train(2)
        at_save = {k: v.clone() for k, v in run.weights().items()}
        moments = backend.named_optimizer_state(run.model, run.optimizer)["state"]
        go, threads = threading.Event(), []
        write = sharded.write

        def held(*args):  # type: ignore[no-untyped-def]
            threads.append(threading.current_thread().name)
            assert go.wait(30), "the test never released the write"
            write(*args)

        monkeypatch.setattr(sharded, "write", held)
        path = run.save(tmp_path, asynchronous=True)
        run.train(3)
        assert any(not torch.equal(at_save[k], v) for k, v in run.weights().items())
        assert not is_complete(path)
        go.set()
        parallelx.wait_for_checkpoint(backend)
        assert threads == ["parallelx-checkpoint"] and is_complete(path)
        weights, optim = sharded.read_whole(path)
        assert all(torch.equal(weights[k], at_save[k]) for k in at_save), "a later update reached the shards"
        for name, entry in moments.items():
            for key, value in entry.items():
                assert torch.equal(optim[name][key], value), f"a later update reached {name}'s {key}"
