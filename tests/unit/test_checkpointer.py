"""parallelx.Checkpointer in one process (the single backend): where a resumed
loop continues, a preemption's stop, parts by name, keep-N, --resume's errors."""

from __future__ import annotations

import ast
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import parallelx
from parallelx import Checkpointer, MetricSums, ParallelxError

ROOT = Path(__file__).resolve().parents[2]
N, BATCH, EPOCHS = 40, 4, 2  # 10 micro-batches an epoch


class Indexed(Dataset):
    """(x, y, index): the index tells which samples a loop trained on."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(N, 3, generator=g), torch.randint(0, 2, (N,), generator=g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


@pytest.fixture
def backend():
    with parallelx.get_backend("single") as b:
        yield b


def loop(backend, run_dir: Path, *, resume: str | None = None, stop_at: int | None = None, **options: Any):
    """A user's loop: 2 epochs, a stop request after optimizer step ``stop_at``.
    Returns (checkpointer, model, the sample indices trained on)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = backend.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    sampler = backend.make_sampler(Indexed(), shuffle=True, seed=1)
    loader = DataLoader(Indexed(), batch_size=BATCH, sampler=sampler)
    sums = MetricSums(sampler)
    ckpt = Checkpointer(
        backend,
        run_dir,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        sampler=sampler,
        sums=sums,
        per_epoch={"seen": []},
        history=[],
        **options,
    )
    ckpt.resume(resume)
    with ckpt:
        for epoch in ckpt.epochs(EPOCHS):
            for x, y, i in ckpt.batches(loader):
                losses = nn.functional.cross_entropy(model(x), y, reduction="none")
                backend.backward(losses.mean())
                sums.update(losses, None)
                ckpt["seen"] += i.tolist()
                if backend.step(optimizer, scheduler) is None:
                    continue
                if ckpt.global_step + 1 == stop_at:
                    ckpt.preemption.request()
                if ckpt.step():
                    return ckpt, model, None
            ckpt["history"].append({"epoch": epoch, "loss": sums.compute(backend)["loss"], "seen": ckpt["seen"]})
    return ckpt, model, ckpt["history"]


def test_a_preempted_loop_resumes_where_it_stopped_bitwise(backend, tmp_path):
    _, whole, history = loop(backend, tmp_path / "whole")
    run = tmp_path / "cut"
    ckpt, _, stopped = loop(backend, run, every=4, stop_at=13)  # epoch 2, 3 micro-batches in
    assert stopped is None and ckpt.preempted
    assert (ckpt.epoch, ckpt.batch, ckpt.global_step) == (2, 3, 13)
    assert parallelx.latest_checkpoint(run).name == "step-00000013"
    again, model, resumed = loop(backend, run, resume="auto")
    assert again.path == run / "checkpoints" / "step-00000013"
    assert resumed == history, "the history (sums, per-epoch values, samples seen) differs"
    assert torch.equal(model.weight, whole.weight) and torch.equal(model.bias, whole.bias)
    assert again.global_step == 20 and again.epoch == 3


def test_the_stop_at_an_epoch_end_ends_the_epochs(backend, tmp_path):
    ckpt, _, history = loop(backend, tmp_path, every=100, stop_at=10)  # the epoch's last step: seen at its end
    assert ckpt.preempted and history is not None and len(history) == 1
    assert (ckpt.epoch, ckpt.batch, ckpt.global_step) == (2, 0, 10)
    assert parallelx.latest_checkpoint(tmp_path).name == "step-00000010"


def test_without_every_or_resume_nothing_is_written_and_sigterm_is_not_caught(backend, tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    ckpt, _, history = loop(backend, tmp_path, stop_at=3)
    assert not ckpt.enabled and not ckpt.preempted and len(history) == EPOCHS
    assert not (tmp_path / "checkpoints").exists()
    assert signal.getsignal(signal.SIGTERM) == before
    ckpt, _, _ = loop(backend, tmp_path, every=100)
    assert ckpt.enabled and signal.getsignal(signal.SIGTERM) == before  # restored after the with


def test_keep_rotates_the_oldest_out(backend, tmp_path):
    loop(backend, tmp_path, every=3, keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step-00000018", "step-00000020"]


def test_a_bad_resume_is_one_clear_error(backend, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ParallelxError, match="no checkpoint there"):
        loop(backend, tmp_path, resume=str(tmp_path / "empty"))
    ckpt, _, _ = loop(backend, tmp_path / "fresh", resume="auto")  # auto with none: from the start
    assert ckpt.path is None and ckpt.global_step == 20
    model = nn.Linear(3, 2)
    parts = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), 0.1)}
    path = parallelx.save_training_state(backend, tmp_path / "other", step=1, counters={"epoch": 1}, **parts)
    with pytest.raises(ParallelxError, match="not written by a parallelx.Checkpointer"):
        Checkpointer(backend, tmp_path, **parts).resume(str(path))


def test_several_models_and_optimizers_by_name(backend, tmp_path):
    def parts(seed: int) -> dict[str, Any]:
        torch.manual_seed(seed)
        gen, disc = nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 1))
        gen_opt, disc_opt = torch.optim.Adam(gen.parameters()), torch.optim.SGD(disc.parameters(), 0.1, momentum=0.9)
        return {
            "gen": gen,
            "disc": disc,
            "gen_opt": gen_opt,
            "disc_opt": disc_opt,
            "gen_sched": torch.optim.lr_scheduler.StepLR(gen_opt, 1),
            "best": 0.0,
        }

    a = parts(0)
    for _ in range(2):
        a["disc"](a["gen"](torch.randn(5, 3))).sum().backward()
        a["gen_opt"].step(), a["disc_opt"].step(), a["gen_sched"].step()
    saver = Checkpointer(backend, tmp_path, every=1, **a)
    saver["best"] = 0.5
    path = saver.save()
    state = torch.load(path / "state.pt", weights_only=True)
    assert sorted(state["models"]) == ["disc", "gen"] and sorted(state["optimizers"]) == ["disc_opt", "gen_opt"]
    assert state["meta"]["pairs"] == {"gen_opt": "gen", "disc_opt": "disc"}
    assert state["meta"]["optimizers"] == {"gen_opt": "Adam", "disc_opt": "SGD"}
    b = parts(1)
    loader = Checkpointer(backend, tmp_path, **b)
    assert loader.resume(str(path)) == path and loader["best"] == 0.5
    for name in ("gen", "disc"):
        sa, sb = a[name].state_dict(), b[name].state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), name
    assert str(a["gen_opt"].state_dict()) == str(b["gen_opt"].state_dict())
    assert b["gen_sched"].state_dict() == a["gen_sched"].state_dict()
    with pytest.raises(ParallelxError, match="which model does optimizer 'opt' train"):
        Checkpointer(backend, tmp_path, every=1, g=nn.Linear(1, 1), d=nn.Linear(1, 1), opt=a["gen_opt"]).save()


def test_values_are_checked_by_name(backend, tmp_path):
    ckpt = Checkpointer(backend, tmp_path, model=nn.Linear(1, 1), best=1.0)
    with pytest.raises(ParallelxError, match="no value named 'bset'"):
        ckpt["bset"] = 2.0
    with pytest.raises(ParallelxError, match="neither a model"):
        Checkpointer(backend, tmp_path, thing=object())
    with pytest.raises(ParallelxError, match="every"):
        Checkpointer(backend, tmp_path, every=0)


def test_without_a_sampler_the_trained_batches_are_skipped(backend, tmp_path):
    batches = [torch.full((2,), float(i)) for i in range(6)]
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(backend, tmp_path, every=1, model=model, optimizer=optimizer, seen=[])

    def train() -> None:
        with ckpt:
            for _ in ckpt.epochs(1):
                for x in ckpt.batches(batches):
                    model(x).sum().backward()
                    backend.step(optimizer)
                    ckpt["seen"] += [int(x[0])]
                    if ckpt.global_step + 1 == 2:
                        ckpt.preemption.request()
                    if ckpt.step():
                        return

    train()
    assert ckpt.preempted and ckpt.batch == 2
    again = Checkpointer(backend, tmp_path, model=model, optimizer=optimizer, seen=[])
    again.resume("auto")
    assert again["seen"] == [0, 1] and [int(x[0]) for x in again.batches(batches)] == [2, 3, 4, 5]


def test_it_reads_no_private_names_of_other_objects():
    tree = ast.parse((ROOT / "parallelx" / "checkpoints" / "checkpointer.py").read_text())
    private = [
        ast.unparse(n)
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and n.attr.startswith("_")
        and not (n.attr.startswith("__") and n.attr.endswith("__"))
        and not (isinstance(n.value, ast.Name) and n.value.id == "self")
    ]
    assert not private, f"private names of other objects: {private}"
