"""Checkpoint IO: portable state, atomic writes, reads.

A parallelx checkpoint is one plain PyTorch file: every model is replaced by
its unwrapped ``state_dict`` and every optimizer by a plain ``torch.optim``
state dict, all on the CPU, so ``torch.load(path, weights_only=True)`` reads it
anywhere, with no backend package and at any world size.  Gathering sharded
state is the backend's state part (:mod:`parallelx.parts.stateio`); this module
only walks, writes and reads.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallelx import storage
from parallelx.errors import ParallelxError, first_line
from parallelx.parts.state import to_cpu  # noqa: F401  (parallelx.parts.portable.to_cpu is documented)

# The local writes live with the rest of the storage seam; their names here are documented.
from parallelx.storage import atomic_write, fsync_dir, write_synced  # noqa: F401


def is_optimizer(obj: Any) -> bool:
    """A torch optimizer, or anything shaped like one (a backend's wrapper)."""
    return isinstance(obj, torch.optim.Optimizer) or (
        callable(getattr(obj, "state_dict", None)) and hasattr(obj, "param_groups")
    )


def portable(obj: Any, model_state: Callable[[nn.Module], Any], optimizer_state: Callable[[Any], Any]) -> Any:
    """``obj`` with models and optimizers replaced by what the two functions return.
    Walks dicts, lists and tuples; the order of the walk is the same on every
    rank, which matters when the functions are collectives."""
    if isinstance(obj, nn.Module):
        return model_state(obj)
    if is_optimizer(obj):
        return optimizer_state(obj)
    if isinstance(obj, Mapping):
        return {k: portable(v, model_state, optimizer_state) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(portable(v, model_state, optimizer_state) for v in obj)
    return obj


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save`` through :func:`atomic_write`; a URL (``s3://...``) through :mod:`parallelx.storage`."""
    storage.save(obj, storage.location(path))


def load(path: str | os.PathLike[str], *, weights_only: bool = True) -> Any:
    """Read a checkpoint onto the CPU; a missing or unreadable file is one clear error.
    A URL (``s3://...``) is read through :mod:`parallelx.storage`, as strictly."""
    return storage.load(storage.location(path), weights_only=weights_only)


#: Below this much free space after a failed write, the error says the disk is the likely cause.
LOW_DISK_BYTES = 1 << 30


def write_failure(path: str | os.PathLike[str], exc: BaseException) -> str:
    """``exc`` of a failed checkpoint write, with the free space of ``path``'s disk when that is the
    likely cause: torch reports a full disk as ``unexpected pos 469923264 vs 469923152``."""
    text = f"{type(exc).__name__}: {exc}"
    if storage.is_url(path):  # a store's own errors say the cause (no local disk to look at)
        return f"{type(exc).__name__}: {first_line(exc)}"
    where = Path(path).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return text
    full = isinstance(exc, OSError) and exc.errno == errno.ENOSPC
    if full or free < LOW_DISK_BYTES:
        text += f" (the disk holding {where} has {free / 2**20:,.0f} MiB free: a full disk is the likely cause)"
    return text


def save_on_main(
    state: Any, path: str | os.PathLike[str], *, is_main: bool, broadcast: Callable[[str | None], str | None]
) -> None:
    """Rank 0 writes ``state`` atomically; every rank returns once the file
    exists, or raises the same error (``broadcast`` sends rank 0's word to
    every rank and doubles as the barrier)."""
    error: str | None = None
    if is_main:
        try:
            atomic_save(state, path)
        except Exception as exc:  # reported to every rank below
            error = f"saving {path} failed on rank 0: {write_failure(path, exc)}"
    error = broadcast(error)
    if error is not None:
        raise ParallelxError(error)
