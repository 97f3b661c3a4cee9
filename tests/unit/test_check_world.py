"""The check's one-process reference (``parallelx.check.world``) and its probe
(``parallelx.check.probe``), in this process: the virtual ranks read exactly
the batches (and draw exactly the random numbers) that real ranks read, and
the reference's gradients are the average of the ranks' gradients."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset

import parallelx
from parallelx.backend import OBSERVERS_ENV
from parallelx.check import probe as checkprobe
from parallelx.check import world as virtualworld
from parallelx.check.world import StepsOfN, VirtualWorld
from parallelx.parts.sampler import ShardedSampler

N = 2


class Noisy(Dataset):
    """Each item draws from torch's global generator (random augmentation in the main process)."""

    def __len__(self) -> int:
        return 21

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)]) + torch.rand(1)


class Echo(Dataset):
    """Returns its keys: what the loader's sampler handed out."""

    def __len__(self) -> int:
        return 21

    def __getitem__(self, key: object) -> object:
        return key


class Keys(Sampler):
    """A wrapper sampler, as the recipes' EpochKeys: reads last_epoch right after iter()."""

    def __init__(self, sampler: ShardedSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[tuple[int, int]]:
        indices = iter(self.sampler)
        epoch = self.sampler.last_epoch
        assert epoch is not None
        return ((epoch, i) for i in indices)

    def __len__(self) -> int:
        return len(self.sampler)


@pytest.fixture
def world():
    """A virtual world of N ranks with its process-wide patches, removed afterwards."""
    w = VirtualWorld(N, lambda: [], lambda: (False, 0, True, False))
    virtualworld.install()
    yield w
    virtualworld.uninstall()


def real_batches(dataset: Dataset, rank: int, batch_size: int, drop_last: bool = False, seed: int = 0) -> list:
    torch.manual_seed(seed)
    sampler = ShardedSampler(dataset, num_replicas=N, rank=rank, shuffle=True, seed=3)
    return [b.tolist() for b in DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last)]


@pytest.mark.parametrize("drop_last", [False, True])
def test_virtual_ranks_read_each_rank_s_batches_in_turn(world, drop_last):
    data = TensorDataset(torch.arange(21.0))
    like = ShardedSampler(data, num_replicas=N, rank=0, shuffle=True, seed=3)
    sampler = world.sampler(like, data)
    loader = DataLoader(data, batch_size=4, sampler=sampler, drop_last=drop_last)
    assert len(sampler) == len(like) and len(loader) == len(
        DataLoader(data, batch_size=4, sampler=like, drop_last=drop_last)
    )

    def rank_batches(rank: int, epoch: int) -> list[list[float]]:
        real = ShardedSampler(data, num_replicas=N, rank=rank, shuffle=True, seed=3)
        real.set_epoch(epoch)
        return [b[0].tolist() for b in DataLoader(data, batch_size=4, drop_last=drop_last, sampler=real)]

    for epoch in range(2):  # a new shuffle each pass, as on the ranks
        got = [b[0].tolist() for b in loader]
        per_rank = [rank_batches(r, epoch) for r in range(N)]
        assert got == [per_rank[r][j] for j in range(len(per_rank[0])) for r in range(N)]
        assert [len(b) for b in got][-2:] == ([4, 4] if drop_last else [3, 3])  # each rank's short last batch, apart


def test_a_wrapper_sampler_is_followed(world):
    data = TensorDataset(torch.arange(21.0))
    sampler = world.sampler(ShardedSampler(data, num_replicas=N, rank=0, shuffle=True, seed=3), data)
    keys = list(DataLoader(Echo(), batch_size=4, sampler=Keys(sampler), collate_fn=lambda b: b))
    real = [
        [
            list(b)
            for b in DataLoader(
                Echo(),
                batch_size=4,
                collate_fn=lambda b: b,
                sampler=Keys(ShardedSampler(data, num_replicas=N, rank=r, shuffle=True, seed=3)),
            )
        ]
        for r in range(N)
    ]
    assert keys == [real[r][j] for j in range(3) for r in range(N)]


def test_each_virtual_rank_draws_the_random_numbers_its_rank_draws(world):
    data = Noisy()
    sampler = world.sampler(ShardedSampler(data, num_replicas=N, rank=0, shuffle=True, seed=3), data)
    torch.manual_seed(0)
    got = [b.tolist() for b in DataLoader(data, batch_size=4, sampler=sampler)]
    real = [real_batches(data, r, 4) for r in range(N)]
    assert got == [real[r][j] for j in range(len(real[0])) for r in range(N)]


def test_metric_sums_over_the_virtual_ranks_count_every_sample_once(world):
    data = TensorDataset(torch.arange(21.0), torch.zeros(21, dtype=torch.long))
    sampler = world.sampler(ShardedSampler(data, num_replicas=N, rank=0, shuffle=False), data)
    sums = parallelx.MetricSums(sampler)
    for x, _ in DataLoader(data, batch_size=4, sampler=sampler):
        sums.update(x, torch.ones(len(x), dtype=torch.bool))
    m = sums.compute()
    assert m["count"] == 21 and m["loss"] == pytest.approx(10.0)  # the padding duplicate left out


def test_a_held_back_step_applies_the_average_of_the_ranks_gradients():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    xs = [torch.randn(5, 3), torch.randn(5, 3)]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    held = StepsOfN(opt, N, lambda: (False, 0, True, False))
    virtualworld._HELD[opt] = held
    held.install()
    for x in xs:  # the protocol form, as each rank runs it
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    # One process on the average of the two ranks' gradients:
    ref = nn.Linear(3, 1)
    ref.load_state_dict(start)
    grads = []
    for x in xs:
        ref.zero_grad()
        ref(x).pow(2).mean().backward()
        grads.append([p.grad.clone() for p in ref.parameters()])
    with torch.no_grad():
        for p, g0, g1 in zip(ref.parameters(), *grads):
            p -= 0.5 * (g0 + g1) / 2
    for (k, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-7), k
    assert held.pending == 0


def test_the_probe_records_a_run_and_the_reference_averages_the_ranks(tmp_path, monkeypatch):
    """The loop form on the reference (one process playing 2 ranks): its step-1 gradients
    are the average of what each rank computes on its batch, and the record says so."""
    threads = torch.get_num_threads()
    monkeypatch.setenv(OBSERVERS_ENV, "parallelx.check.probe:attach")
    monkeypatch.setenv(checkprobe.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(checkprobe.ENV_STEPS, "50")  # more than the run takes: it ends at shutdown
    monkeypatch.setenv(checkprobe.ENV_RANKS, str(N))
    data = TensorDataset(torch.randn(24, 3, generator=torch.Generator().manual_seed(1)), torch.randn(24, 1))
    try:
        backend = parallelx.get_backend("single", loggers="csv", log_dir=tmp_path / "logs").init()
        assert backend.world_size == N and any(isinstance(o, checkprobe.Probe) for o in backend.observers)
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        start = {k: v.clone() for k, v in model.state_dict().items()}
        model, opt = backend.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        loader = DataLoader(data, batch_size=4, sampler=backend.make_sampler(data, seed=5))
        loop = backend.loop
        for i, (x, y) in enumerate(backend.batches(loader)):
            backend.backward(nn.functional.mse_loss(model(x), y))
            backend.step(opt)
            if i == 3:  # two steps of two virtual ranks
                break
        # The probe watches the loop and replaces nothing: the same loop, its marks still the monitor's.
        assert backend.loop is loop and loop.meter is backend.monitor and backend.monitor.steps == 2
        backend.shutdown()
    finally:
        virtualworld.uninstall()
        torch.set_num_threads(threads)
    record = json.loads((tmp_path / "rank0.json").read_text())
    assert record["virtual_ranks"] == N and record["steps_done"] == 2 and record["reference"]["limits"] == []
    assert [(m["step"], m["rank"]) for m in record["micro"]] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert len(record["losses"]) == 4 and record["steps"][0]["groups"] == [
        {"lr": 0.1, "momentum": 0.0, "weight_decay": 0.0, "dampening": 0.0}
    ]
    grads = torch.load(tmp_path / "grads.pt", weights_only=True)
    # Each rank's first batch, and its gradient from the same start:
    expected = {"weight": 0, "bias": 0}
    for r in range(N):
        idx = next(
            iter(DataLoader(range(24), batch_size=4, sampler=ShardedSampler(data, num_replicas=N, rank=r, seed=5)))
        )
        plain = nn.Linear(3, 1)
        plain.load_state_dict(start)
        nn.functional.mse_loss(plain(data.tensors[0][idx]), data.tensors[1][idx]).backward()
        expected = {k: expected[k] + getattr(plain, k).grad / N for k in expected}
    for k in expected:
        assert torch.allclose(grads[k], expected[k], atol=1e-7), k
    assert (tmp_path / "weights.pt").is_file()


def test_the_script_s_own_clipping_clips_the_average_once(world):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    xs = [torch.randn(5, 3) * 10, torch.randn(5, 3) * 10]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    held = StepsOfN(opt, N, lambda: (False, 0, True, False))
    virtualworld._HELD[opt] = held
    held.install()
    for x in xs:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        opt.step()
    ref = nn.Linear(3, 1)
    ref.load_state_dict(start)
    ref.zero_grad()
    for x in xs:
        (ref(x).pow(2).mean() / N).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    assert norm > 0.1  # it clips
    torch.nn.utils.clip_grads_with_norm_(list(ref.parameters()), 0.1, norm)
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.5 * p.grad
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
