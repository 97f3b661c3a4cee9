"""The mesh part: where this process stands in the grid of data-parallel x
tensor-parallel ranks (``--tensor-parallel N``, :mod:`parallelx.tensor_parallel`).

The world of W processes is a grid of W/N data-parallel ranks by N
tensor-parallel ranks, tensor-parallel innermost: ranks ``d*N .. d*N+N-1`` hold
the slices of one copy of the model, so that on GPUs one tensor-parallel group
stays inside one machine (its collectives run in every layer's forward and
backward).  The data follows the data-parallel coordinate only: the N ranks of
one group read the same batch (``make_sampler``, ``gather_in_order`` and
``MetricSums`` take it from here), while ``backend.rank`` and
``backend.world_size`` keep meaning the process.

Without ``--tensor-parallel`` the mesh is the world itself (:meth:`Mesh.whole`):
data rank = rank, data size = world size, one tensor-parallel rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from parallelx.errors import ParallelxError
from parallelx.parts.collectives import Collectives

__all__ = ["Mesh", "check_degree", "tensor_parallel_groups"]


@dataclasses.dataclass(frozen=True)
class Mesh:
    """This process's coordinates in the data-parallel x tensor-parallel grid."""

    #: Which copy of the data this process reads, and how many there are.
    data_rank: int
    data_size: int
    #: Which slice of each split layer this process holds, and how many slices there are.
    tp_rank: int = 0
    tp_size: int = 1
    #: Collectives over the data-parallel group (the ranks that read different batches): what
    #: metrics and gathered predictions are reduced over.  The world's when ``tp_size`` is 1.
    data_comm: Collectives | None = dataclasses.field(default=None, repr=False, compare=False)
    #: ``torch.distributed`` groups (None in a world without tensor parallelism).
    tp_group: Any = dataclasses.field(default=None, repr=False, compare=False)
    dp_group: Any = dataclasses.field(default=None, repr=False, compare=False)
    #: torch's ``DeviceMesh`` of the data-parallel ranks, for an engine that takes one (FSDP2).
    dp_mesh: Any = dataclasses.field(default=None, repr=False, compare=False)

    @classmethod
    def whole(cls, rank: int, world_size: int, comm: Collectives | None) -> Mesh:
        """The mesh of a world with no tensor parallelism: every rank its own data."""
        return cls(data_rank=rank, data_size=world_size, data_comm=comm)

    @property
    def tensor_parallel(self) -> bool:
        return self.tp_size > 1

    def describe(self) -> str:
        return f"data-parallel rank {self.data_rank} of {self.data_size}, tensor-parallel rank {self.tp_rank} of {self.tp_size}"


def check_degree(tensor_parallel: int, world_size: int, who: str) -> None:
    """``--tensor-parallel N`` must divide the world into groups of N."""
    if tensor_parallel < 1:
        raise ParallelxError(f"{who}: --tensor-parallel must be at least 1, got {tensor_parallel}")
    if world_size % tensor_parallel:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ParallelxError(
            f"{who}: --tensor-parallel {tensor_parallel} does not divide the world of {world_size} processes into "
            f"groups of {tensor_parallel}: give one of {', '.join(map(str, divisors))}, or start a multiple of "
            f"{tensor_parallel} processes"
        )


def tensor_parallel_groups(world_size: int, tensor_parallel: int) -> list[list[int]]:
    """The ranks of each tensor-parallel group, tensor-parallel innermost: rank = data_rank * N + tp_rank."""
    n = tensor_parallel
    return [list(range(d * n, d * n + n)) for d in range(world_size // n)]
