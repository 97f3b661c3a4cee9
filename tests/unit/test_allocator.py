"""The CPU allocator setting of fsdp and ZeRO-3 (backends/_allocator.py): glibc's mmap threshold at
1 MiB through set-up and the first step, raised once that step has run (the step's blocks then come
from the heaps, without a page fault each), kept at 1 MiB for good when PARALLELX_LOW_MEMORY asks."""

import os
import sys

import pytest
import torch

from parallelx.backends import _allocator

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")


@pytest.fixture
def fresh(monkeypatch):
    for k in [k for k in os.environ if k.startswith("MALLOC_")] + ["LD_PRELOAD", _allocator.LOW_MEMORY]:
        monkeypatch.delenv(k, raising=False)
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(_allocator, "_steady", False)
    monkeypatch.setattr(_allocator, "_mallopt", None)
    real = _allocator._glibc_mallopt

    def recording(device):
        mallopt = real(device)
        if mallopt is None:
            return None

        def record(param, value):
            calls.append((param, value))
            return mallopt(param, value)

        return record

    monkeypatch.setattr(_allocator, "_glibc_mallopt", recording)
    return calls


def one_step() -> torch.optim.Optimizer:
    w = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([w], lr=0.1)
    _allocator.after_first_step(optimizer)
    w.sum().backward()
    return optimizer


def test_the_threshold_is_raised_after_the_first_step_and_only_once(fresh):
    assert _allocator.return_freed_memory(torch.device("cpu"))
    assert fresh == [(_allocator.M_MMAP_THRESHOLD, _allocator.THRESHOLD)]
    optimizer = one_step()
    optimizer.step()
    raised = [
        (_allocator.M_MMAP_THRESHOLD, _allocator.STEADY_MMAP_THRESHOLD),
        (_allocator.M_TRIM_THRESHOLD, _allocator.STEADY_TRIM_THRESHOLD),
    ]
    assert fresh[1:] == raised
    optimizer.step()
    one_step().step()  # a second optimizer's first step: already switched
    assert fresh[1:] == raised


def test_low_memory_keeps_one_mib_throughout(fresh, monkeypatch):
    monkeypatch.setenv(_allocator.LOW_MEMORY, "1")
    assert _allocator.return_freed_memory(torch.device("cpu"))
    one_step().step()
    assert fresh == [(_allocator.M_MMAP_THRESHOLD, _allocator.THRESHOLD)]


def test_a_users_own_allocator_setting_is_left_alone(fresh, monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert not _allocator.return_freed_memory(torch.device("cpu"))
    one_step().step()
    assert fresh == []
