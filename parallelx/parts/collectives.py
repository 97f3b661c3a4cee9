"""The collectives part of a backend: reduce, broadcast, barrier and gather
over the ranks of one world.

Each backend family gives one subclass with its own communication library
(:class:`parallelx.strategies.single_process.LocalCollectives` for a world of one process,
:class:`parallelx.strategies.process_group.ProcessGroupCollectives` for
``torch.distributed``, Horovod's in ``backends/horovod.py``).  A subclass
implements four primitives (:meth:`reduce_`, :meth:`broadcast`,
:meth:`barrier`, :meth:`all_gather_list`); everything else (``mean``, the
gathering of :mod:`parallelx.parts.gather`) is built on them here, once, so that it
means the same on every backend.  Blocking calls run under the backend's
watchdog (:class:`parallelx.parts.watchdog.Watchdog`), for libraries that could
wait for ever for a stalled peer.
"""

from __future__ import annotations

import abc
import contextlib
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from parallelx.errors import ParallelxError
from parallelx.forensics import record
from parallelx.settings import ReduceOp, check_op

T = TypeVar("T")

#: Arms a watchdog around one blocking call: ``with watch("barrier"): ...``.
Watch = Callable[[str], contextlib.AbstractContextManager[Any]]


def no_watch(what: str) -> contextlib.AbstractContextManager[None]:
    """The :data:`Watch` of a library that times out by itself."""
    return contextlib.nullcontext()


class Collectives(abc.ABC):
    """Collectives over the ``world_size`` ranks of one world, seen from ``rank``."""

    def __init__(self, rank: int, world_size: int, watch: Watch = no_watch) -> None:
        self.rank = rank
        self.world_size = world_size
        #: Arms the backend's watchdog around a blocking call.
        self.watch = watch

    def comm_device(self, tensor: torch.Tensor) -> torch.device:
        """Where the library needs ``tensor`` to be for a collective."""
        return tensor.device

    @abc.abstractmethod
    def reduce_(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """Reduce ``tensor`` (on :meth:`comm_device`; ``sum``, ``max`` or ``min``)
        over all ranks and return the result; may work in place."""

    @abc.abstractmethod
    def broadcast(self, obj: T, src: int = 0) -> T:
        """Rank ``src``'s ``obj`` on every rank.  Tensors travel as tensors (same
        shape and dtype on every rank); anything else is pickled."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Wait until every rank reaches this point."""

    @abc.abstractmethod
    def all_gather_list(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (on :meth:`comm_device`, contiguous, not bool)
        as a list indexed by rank.  The first dimension may differ between
        ranks; the other sizes and the dtype are the same on every rank."""

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Reduce ``tensor`` over all ranks into a new tensor on its device (the
        input is left unchanged); ``mean`` of an integer tensor is a float."""
        check_op(op)
        out = tensor.detach().to(self.comm_device(tensor), copy=True)
        if op == "mean" and not out.is_floating_point():
            out = out.double()
        # Gloo has no AVG: every backend sums and divides, so mean means the same everywhere.
        with self.watch("all_reduce"):
            record.describe(out)
            self.agree_shapes("all_reduce", out)
            out = self.reduce_(out, "sum" if op == "mean" else op)
        if op == "mean":
            out = out / self.world_size
        return out.to(tensor.device)

    def agree_(self, table: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The sum over the ranks of ``table`` (int64, on the CPU) for :meth:`agree_shapes`, back on the CPU.

        Here over the collectives' own wire (on ``device``).  A library whose engines share that wire with
        these collectives (``torch.distributed``: DDP's gradient buckets, FSDP's and ZeRO's reductions) sums
        it over a channel of its own instead: there one rank's agreement cannot pair with an engine's
        reduction on another rank (Gloo aborts the process on the size mismatch, "Received data size
        doesn't match expected size", before any verdict; a reduction of the same size would mix the two
        silently), it waits for the others, and the verdict names both calls."""
        return self.reduce_(table.to(device), "sum").cpu()

    def agree_shapes(self, kind: str, tensor: torch.Tensor) -> None:
        """Raise on every rank when the ranks pass tensors of different shapes or dtypes to one
        collective: Gloo ends the process from a thread of its own on that (``Received data size
        doesn't match expected size``), before any error can name the call.  One small all-reduce of
        every rank's shape, beside the collective itself."""
        if self.world_size <= 1 or not AGREE_SHAPES:
            return
        mine = [_KINDS.index(kind) + 1, *_shape_row(tensor)]
        table = torch.zeros((self.world_size, len(mine)), dtype=torch.int64)
        table[self.rank] = torch.tensor(mine, dtype=torch.int64)
        rows = [tuple(int(n) for n in row) for row in self.agree_(table, self.comm_device(tensor))]
        if all(row == rows[0] for row in rows):
            return
        if any(row[0] != rows[0][0] for row in rows):
            kinds = "; ".join(f"rank {r}: {_KINDS[row[0] - 1] if row[0] else '?'}" for r, row in enumerate(rows))
            raise record.Parted(f"{kind}: the ranks are at different collectives ({kinds})")
        rows = [row[1:] for row in rows]
        seen = "; ".join(f"rank {r}: {_shape_text(row)}" for r, row in enumerate(rows))
        raise ParallelxError(
            f"{kind}: the ranks passed tensors of different shapes or dtypes ({seen}): every rank must pass the "
            "same shape and dtype (gather rows of different lengths with backend.all_gather, which pads them)"
        )


#: ``$PARALLELX_AGREE_SHAPES=0`` leaves the shape agreement out (one small all-reduce less per
#: ``all_reduce`` and tensor ``broadcast``; a mismatch then ends in the transport's own words).
AGREE_SHAPES = os.environ.get("PARALLELX_AGREE_SHAPES", "1") != "0"

#: The dtypes told apart in :meth:`Collectives.agree_shapes` (others share the last code).
_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]
_MAX_DIMS = 8
_KINDS = ["all_reduce", "broadcast"]


def _shape_row(tensor: torch.Tensor) -> list[int]:
    dims = list(tensor.shape)[:_MAX_DIMS]
    code = _DTYPES.index(tensor.dtype) + 1 if tensor.dtype in _DTYPES else len(_DTYPES) + 1
    return [code, tensor.dim(), *dims, *([0] * (_MAX_DIMS - len(dims)))]


def _shape_text(row: tuple[int, ...]) -> str:
    code, ndim = row[0], row[1]
    dtype = str(_DTYPES[code - 1]).replace("torch.", "") if code <= len(_DTYPES) else "other"
    return f"[{', '.join(str(n) for n in row[2 : 2 + ndim])}] {dtype}"


class LocalCollectives(Collectives):
    """A world of one process: every collective returns this rank's own values."""

    def __init__(self) -> None:
        super().__init__(rank=0, world_size=1)

    def reduce_(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        return tensor

    def broadcast(self, obj: T, src: int = 0) -> T:
        if src != 0:
            raise ParallelxError(f"broadcast from rank {src} in a world of 1 process (only rank 0 exists)")
        return obj

    def barrier(self) -> None:
        pass

    def all_gather_list(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor.clone()]
