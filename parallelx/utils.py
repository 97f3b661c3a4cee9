"""Small backend-agnostic helpers."""

from __future__ import annotations

import importlib.util
import os
import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices).  Use the same seed on every
    rank so that every rank builds the same initial model."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def threads_per_process(local_world_size: int) -> int:
    """CPU threads for each of ``local_world_size`` processes on one machine, so
    that together they do not oversubscribe the cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_world_size))


def has_batchnorm(model: torch.nn.Module) -> bool:
    """True when ``model`` has a BatchNorm layer: its statistics are where data
    parallelism differs from one device on the whole batch."""
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def missing_package(module: str | None, install_hint: str) -> str | None:
    """Why a backend needing ``module`` cannot run here, or None.  Only looks
    (``find_spec``): the heavy package is not imported."""
    if module is None:
        return None
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else f"the {module} package is not installed; {install_hint}"


class lazy_module:
    """``name``, imported on its first attribute access rather than now: for
    what a backend needs only once it runs (FSDP2 and DTensor cost about a
    second of start-up), while every process reads every backend's options.
    Not placed in ``sys.modules`` until imported for real, so that nothing
    that walks the loaded modules (``inspect``, ``warnings``) triggers it."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self._name), attr)


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor: a ``DTensor`` (``--loss-parallel``'s logits and losses) as its whole
    value, which parallelx's metrics and collectives then treat as any other tensor."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t
