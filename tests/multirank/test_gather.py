"""Gathering and synchronised BatchNorm in-process: the world-of-one backends,
the sampler's order bookkeeping, and the protocol's own logic in a world of
threads (each thread a rank; collectives meet at a barrier).  The launcher
tests are in ``tests/launcher/test_gather_launch.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from threads import ThreadBackend, in_threads
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import parallelx
from parallelx import ParallelxError, ShardedSampler
from parallelx.transforms.batchnorm import SyncBatchNorm

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def single():
    with parallelx.get_backend("single", device="cpu", verbose=False) as backend:
        yield backend


def one_pass(sampler: ShardedSampler) -> list[int]:
    return list(iter(sampler))


# ------------------------------------------------------------------ sampler
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("size", [1, 5, 23])
@pytest.mark.parametrize("shuffle", [True, False])
def test_dataset_index_puts_gathered_rows_in_dataset_order(world, size, shuffle):
    samplers = [ShardedSampler(range(size), num_replicas=world, rank=r, shuffle=shuffle, seed=7) for r in range(world)]
    for epoch in range(3):  # every pass has its own order
        if epoch == 2:
            for s in samplers:
                s.set_epoch(10)
        shards = [one_pass(s) for s in samplers]
        gathered = torch.tensor([i for shard in shards for i in shard])  # rank order, padding included
        for s in samplers:
            assert torch.equal(gathered[s.dataset_index()], torch.arange(size))
        assert samplers[0].last_epoch == (10 if epoch == 2 else epoch)


def test_last_order_is_the_latest_pass_not_the_next():
    s = ShardedSampler(range(9), num_replicas=2, rank=1, shuffle=True)
    shard = one_pass(s)
    s.set_epoch(5)  # announces the next pass; the last one is still epoch 0
    assert s.last_order()[1::2] == shard and s.last_epoch == 0


def test_dataset_index_before_any_pass_says_so():
    with pytest.raises(ParallelxError, match="not been iterated yet"):
        ShardedSampler(range(4), num_replicas=2, rank=0).dataset_index()


def test_drop_last_that_drops_samples_cannot_be_put_in_order():
    s = ShardedSampler(range(5), num_replicas=2, rank=0, drop_last=True)
    one_pass(s)
    with pytest.raises(ParallelxError, match="drop_last=True leaves 1 of the 5 samples"):
        s.dataset_index()
    even = ShardedSampler(range(6), num_replicas=2, rank=0, drop_last=True)  # drops nothing
    one_pass(even)
    assert sorted(even.dataset_index().tolist()) == list(range(6))


# ------------------------------------------------------- a world of one
def test_all_gather_in_a_world_of_one(single):
    t = torch.arange(6.0).reshape(3, 2)
    out = single.all_gather(t)
    assert torch.equal(out, t) and out.data_ptr() != t.data_ptr()
    assert single.all_gather(torch.tensor(4)).tolist() == [4]
    flags = single.all_gather(torch.tensor([True, False]))
    assert flags.dtype == torch.bool and flags.tolist() == [True, False]
    assert single.all_gather_object({"a": (1, 2)}) == [{"a": (1, 2)}]


def test_gather_in_order_in_a_world_of_one(single):
    data = TensorDataset(torch.arange(11.0))
    sampler = single.make_sampler(data, shuffle=True, seed=1)
    rows = torch.cat([torch.stack([x, -x], 1) for (x,) in DataLoader(data, batch_size=3, sampler=sampler)])
    assert rows[:, 0].tolist() != list(range(11))  # shuffled
    expected = torch.stack([torch.arange(11.0), -torch.arange(11.0)], 1)
    assert torch.equal(single.gather_in_order(rows, sampler), expected)


def test_gather_in_order_misuse(single):
    data = TensorDataset(torch.arange(11.0))
    sampler = single.make_sampler(data)
    with pytest.raises(ParallelxError, match="not been iterated yet"):
        single.gather_in_order(torch.zeros(11), sampler)
    one_pass(sampler)
    with pytest.raises(ParallelxError, match=r"11 samples per pass, but the ranks gave \[8\] rows"):
        single.gather_in_order(torch.zeros(8), sampler)
    with pytest.raises(ParallelxError, match="needs the parallelx ShardedSampler.*got DistributedSampler"):
        single.gather_in_order(torch.zeros(11), DistributedSampler(data, num_replicas=1, rank=0))
    other = ShardedSampler(data, num_replicas=2, rank=1)
    one_pass(other)
    with pytest.raises(ParallelxError, match="rank 1 of 2, but this is rank 0 of 1"):
        single.gather_in_order(torch.zeros(6), other)


def test_sync_batchnorm_in_a_world_of_one_changes_nothing(single):
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    assert single.sync_batchnorm(model) is model and isinstance(model[1], nn.BatchNorm1d)
    with parallelx.get_backend("dp", device="cpu", verbose=False) as dp:  # DataParallel without 2 GPUs
        assert dp.sync_batchnorm(model) is model and isinstance(model[1], nn.BatchNorm1d)


# ------------------------------------------------------- a world of threads
def test_uneven_rows_and_mismatches_in_a_world_of_three():
    def body(b: ThreadBackend) -> Any:
        rows = b.all_gather(torch.full((b.rank, 2), b.rank))  # rank 0 gives no rows
        errors = []
        for bad in (torch.zeros(2, dtype=torch.float64 if b.rank == 2 else torch.float32), torch.zeros(1, b.rank)):
            try:
                b.all_gather(bad)
            except ParallelxError as exc:
                errors.append(str(exc))
        return rows.tolist(), errors, b.all_gather_object(b.rank * "ab")

    for rows, errors, objects in in_threads(3, body):
        assert rows == [[1, 1], [2, 2], [2, 2]]
        assert "rank 1: [2] torch.float32, rank 2: [2] torch.float64" in errors[0]
        assert "rank 0: [1, 0] torch.float32, rank 1: [1, 1]" in errors[1]
        assert objects == ["", "ab", "abab"]


def test_gather_in_order_in_a_world_of_three():
    data = TensorDataset(torch.arange(20.0))  # padded to 21

    def body(b: ThreadBackend) -> torch.Tensor:
        sampler = b.make_sampler(data, shuffle=True, seed=2)
        for _ in range(2):
            rows = torch.cat([x * 10 for (x,) in DataLoader(data, batch_size=4, sampler=sampler)])
        return b.gather_in_order(rows, sampler)

    for out in in_threads(3, body):
        assert torch.equal(out, torch.arange(20.0) * 10)


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(64, 5),
        nn.BatchNorm1d(5, momentum=None),
    )


def test_generic_sync_batchnorm_matches_one_process_on_the_whole_batch():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(9, 3, 6, 6, generator=g) * 3 + 5, torch.randn(9, 5, generator=g)
    ref = _bn_model()
    x_ref = x.clone().requires_grad_()
    out_ref = ref(x_ref)
    (out_ref * w).sum().backward()
    splits = [(0, 4), (4, 9)]
    models = [_bn_model() for _ in splits]  # here: the threads would race on the global generator

    def body(b: ThreadBackend) -> Any:
        model = b.sync_batchnorm(models[b.rank])
        lo, hi = splits[b.rank]
        xs = x[lo:hi].clone().requires_grad_()
        out = model(xs)
        (out * w[lo:hi]).sum().backward()
        grads = {n: b.all_reduce(p.grad) for n, p in model.named_parameters()}  # local: summed by the optimizer
        return model, out.detach(), xs.grad, grads

    largest = max(float(p.grad.abs().max()) for p in ref.parameters())
    for (lo, hi), (model, out, grad_x, grads) in zip(splits, in_threads(2, body)):
        assert isinstance(model[1], SyncBatchNorm) and isinstance(model[5], SyncBatchNorm)
        assert (out - out_ref.detach()[lo:hi]).abs().max() < 1e-6
        assert (grad_x - x_ref.grad[lo:hi]).abs().max() < 1e-6
        for name, p in ref.named_parameters():
            assert (grads[name] - p.grad).abs().max() / largest < 1e-6, name
        for key, value in ref.state_dict().items():  # running statistics (cumulative with momentum None too)
            assert torch.allclose(model.state_dict()[key].double(), value.double(), rtol=0, atol=1e-6), key
        model.eval()
        assert torch.allclose(model(x[lo:hi]), ref.eval()(x[lo:hi]), rtol=0, atol=1e-6)


def test_sync_batchnorm_keeps_the_parameter_objects():
    models = [_bn_model(), _bn_model()]

    def body(b: ThreadBackend) -> bool:
        model = models[b.rank]
        before = [id(p) for p in model.parameters()]
        return [id(p) for p in b.sync_batchnorm(model).parameters()] == before

    assert in_threads(2, body) == [True, True]
