"""The training-loop options in one process: validation, errors, and the
loop itself on the in-process backends against plain PyTorch."""

from __future__ import annotations

import argparse
import contextlib

import pytest
import torch
from torch import nn

import parallelx
from parallelx.errors import ParallelxError
from parallelx.parts.loop import LoopOptions


def _data(n: int = 7, b: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(b, 5, generator=g), torch.randint(0, 2, (b,), generator=g)) for _ in range(n)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 2))


def _reference(data, accumulate: int, clip: float | None, dtype) -> tuple[nn.Module, list[float]]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    norms = []
    for s in range(0, len(data), accumulate):
        window = data[s : s + accumulate]
        for x, y in window:
            with torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext():
                loss = nn.functional.cross_entropy(model(x), y) * 30
            (loss / len(window)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip or float("inf"))))
        opt.step()
        opt.zero_grad()
    return model, norms


@pytest.mark.parametrize("name", ["single", "dp"])
@pytest.mark.parametrize(
    "options,dtype",
    [
        (dict(accumulate=3, clip_grad_norm=0.5), None),
        (dict(accumulate=2, precision="bf16-mixed"), torch.bfloat16),
    ],
)
def test_loop_equals_plain_torch(name, options, dtype):
    data = _data()
    ref, ref_norms = _reference(data, options.get("accumulate", 1), options.get("clip_grad_norm"), dtype)
    with parallelx.get_backend(name, **options) as backend:
        model = backend.wrap_model(_model())
        opt = backend.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        norms, losses = [], []
        for x, y in backend.batches(data):
            with backend.autocast():
                loss = nn.functional.cross_entropy(model(x), y) * 30
            backend.backward(loss)
            losses.append(loss.item())
            result = backend.step(opt)
            if result is not None:
                assert not result.skipped
                norms.append(float(result.grad_norm))
        for k, v in ref.state_dict().items():
            assert torch.equal(backend.unwrap(model).state_dict()[k], v), k  # same process, same operations
    assert norms == ref_norms
    assert len(norms) == -(-len(data) // options["accumulate"])  # the last, shorter window is applied


def test_options_are_validated():
    with pytest.raises(ParallelxError, match="accumulate must be an integer >= 1"):
        LoopOptions(accumulate=0)
    with pytest.raises(ParallelxError, match="clip_grad_norm must be a finite number > 0"):
        LoopOptions(clip_grad_norm=float("nan"))
    with pytest.raises(ParallelxError, match="precision must be one of 32, bf16-mixed, 16-mixed"):
        LoopOptions(precision="fp8")
    with pytest.raises(ParallelxError, match="grad_compression must be one of none, fp16, bf16"):
        LoopOptions(grad_compression="int8")


def test_cli_options_reach_the_backend():
    parser = argparse.ArgumentParser()
    parallelx.add_arguments(parser)
    args = parser.parse_args(
        ["--backend", "single", "--accumulate", "4", "--clip-grad-norm", "2.5", "--precision", "bf16-mixed"]
    )
    backend = parallelx.from_args(args)
    assert backend.options == LoopOptions(accumulate=4, clip_grad_norm=2.5, precision="bf16-mixed")
    for bad in (["--accumulate", "0"], ["--clip-grad-norm", "-1"], ["--precision", "16"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["--backend", "single", *bad])


def test_16_mixed_needs_a_gpu():
    backend = parallelx.get_backend("single", precision="16-mixed", device="cpu")
    with pytest.raises(ParallelxError, match="16-mixed needs a CUDA GPU.*use bf16-mixed on the CPU"):
        backend.init()
    assert not backend.initialized


def test_horovod_has_no_bf16_on_the_wire():
    pytest.importorskip("horovod")
    with pytest.raises(ParallelxError, match="Horovod has no bfloat16"):
        parallelx.get_backend("horovod", grad_compression="bf16")


def test_accumulation_needs_batches():
    with parallelx.get_backend("single", accumulate=2) as backend:
        model = backend.wrap_model(_model())
        x, y = _data(1)[0]
        with pytest.raises(ParallelxError, match="needs the loop to run over backend.batches"):
            backend.backward(nn.functional.cross_entropy(model(x), y))


def test_batches_without_length_and_limit():
    with parallelx.get_backend("single", accumulate=2) as backend:
        seen = list(backend.batches(iter(range(5))))
        assert seen == [0, 1, 2, 3, 4]
        assert list(backend.batches(range(10), limit=3)) == [0, 1, 2]
        windows = []
        for _ in backend.batches(iter(range(5))):
            windows.append((backend.loop.window.position, backend.loop.window.size))
        assert windows == [(0, 2), (1, 2), (0, 2), (1, 2), (0, 1)]


def test_step_inside_a_window_does_nothing():
    with parallelx.get_backend("single", accumulate=2) as backend:
        model = backend.wrap_model(_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        before = [p.detach().clone() for p in model.parameters()]
        results = []
        for x, y in backend.batches(_data(2)):
            backend.backward(nn.functional.cross_entropy(model(x), y))
            results.append(backend.step(opt))
        assert results[0] is None and results[1] is not None
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_clipping_norm_adds_in_the_model_order_as_torch_does():
    """clip_grad_norm_(model.parameters()) adds the per-parameter norms in the
    model's order; an optimizer whose groups list them in another order must
    still get torch's norm to the bit (the sum of squares rounds differently)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(7, 7) for _ in range(6)])
    params = list(model.parameters())
    groups = [{"params": params[1::2]}, {"params": params[0::2]}]  # biases first, then weights
    with parallelx.get_backend("single", clip_grad_norm=1e9) as backend:
        wrapped, optimizer = backend.setup(model, torch.optim.SGD(groups, lr=0.0))
        differ = 0
        for _ in range(200):
            for p in params:
                p.grad = torch.randn_like(p) * torch.rand(()) * 10
            want = torch.nn.utils.get_total_norm([p.grad for p in params])
            in_groups = torch.nn.utils.get_total_norm([p.grad for g in groups for p in g["params"]])
            differ += int(not torch.equal(want, in_groups))
            got = backend.grad_sync.clip(optimizer, None)
            assert torch.equal(got, want)
        assert differ > 0, "the two orders never rounded apart: the check above cannot fail"
