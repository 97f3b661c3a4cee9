"""DeepSpeed's backward for programs with several models (``DeepSpeedSync.backward``),
on stand-in engines: which engine runs the backward, the boundary left to ``step``,
ZeRO 0's engines told the backward is theirs, and the 16-mixed refusal.  The real
engines run in tests/launcher/test_programs.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from backends.deepspeed import DeepSpeedSync
from parallelx.errors import ParallelxError


class FakeEngine:
    def __init__(self, torch_style: bool) -> None:
        self._support_torch_style_backward = torch_style
        self._running_engine_backward = False
        self._running_engine_backward_count = 0
        self.boundaries: list[bool] = []
        self.calls = 0
        self.seen_running: list[bool] = []
        self.others: list[FakeEngine] = []

    def set_gradient_accumulation_boundary(self, value: bool) -> None:
        self.boundaries.append(value)

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        assert not scale_wrt_gas
        self.calls += 1
        self.seen_running = [e._running_engine_backward for e in self.others]
        loss.backward()


class FakeWrapped:
    def __init__(self, module: nn.Module, engine: FakeEngine) -> None:
        self.module, self.engine, self._engine, self.trains = module, engine, engine, True


def two_models(torch_style: bool, fp16: bool = False) -> tuple[DeepSpeedSync, list[Any]]:
    models = [nn.Linear(2, 2), nn.Linear(2, 1)]
    wrapped = [FakeWrapped(m, FakeEngine(torch_style)) for m in models]
    for w in wrapped:
        w.engine.others = [o.engine for o in wrapped if o is not w]
    config = {"zero_optimization": {"stage": 1 if torch_style else 0}, "fp16": {"enabled": fp16}}
    return DeepSpeedSync(lambda: models, None, config, wrapped), wrapped  # type: ignore[arg-type]


def loss_through_both(wrapped: list[Any]) -> torch.Tensor:
    return wrapped[1].module(wrapped[0].module(torch.ones(1, 2))).sum()


@pytest.mark.parametrize("torch_style", [True, False], ids=["zero1-3", "zero0"])
def test_a_loss_through_two_engines_runs_one_backward_off_the_boundary(torch_style):
    sync, wrapped = two_models(torch_style)
    sync.backward(loss_through_both(wrapped), model=None, boundary=True)
    first, second = wrapped[0].engine, wrapped[1].engine
    assert (first.calls, second.calls) == (1, 0)
    assert first.boundaries == [False] and second.boundaries == [False]  # the reduction runs in step
    # ZeRO 0 refuses a backward it did not start unless told it is its own; ZeRO 1-3's hooks join.
    assert first.seen_running == [not torch_style]
    assert not second._running_engine_backward and second._running_engine_backward_count == 0
    assert all(p.grad is not None for w in wrapped for p in w.module.parameters())


def test_the_named_model_runs_the_backward():
    sync, wrapped = two_models(True)
    sync.backward(loss_through_both(wrapped), model=wrapped[1].module, boundary=True)
    assert (wrapped[0].engine.calls, wrapped[1].engine.calls) == (0, 1)


def test_16_mixed_refuses_a_loss_through_two_engines():
    sync, wrapped = two_models(True, fp16=True)
    with pytest.raises(ParallelxError, match=r"under 16-mixed this loss reaches 2 models' trained parameters"):
        sync.backward(loss_through_both(wrapped), model=None, boundary=True)
    # One model's loss is fine.
    sync.backward(wrapped[1].module(torch.ones(1, 2)).sum(), model=None, boundary=True)
    assert wrapped[1].engine.calls == 1
