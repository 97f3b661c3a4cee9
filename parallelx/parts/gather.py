"""Gathering on any backend: every rank's rows, every rank's objects, and
per-sample rows back in dataset order without the sampler's padding.

Built on the collectives part's one primitive,
:meth:`parallelx.parts.collectives.Collectives.all_gather_list` (equal dtypes and
trailing sizes, first dimensions that may differ), which each backend
implements with its own library.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from parallelx.errors import ParallelxError
from parallelx.parts.collectives import Collectives
from parallelx.parts.sampler import ShardedSampler


def gather_rows(comm: Collectives, tensor: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Every rank's ``tensor`` concatenated along dim 0 in rank order, and the
    number of rows each rank gave."""
    local = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
    # Agree on shapes first, so that a mismatch is one clear error on every rank, not a hang.
    shapes = all_gather_object(comm, (tuple(local.shape), str(local.dtype)))
    if any(s[1:] != shapes[0][0][1:] or d != shapes[0][1] for s, d in shapes):
        seen = ", ".join(f"rank {r}: {list(s)} {d}" for r, (s, d) in enumerate(shapes))
        raise ParallelxError(
            f"all_gather needs the same dtype and the same sizes after dim 0 on every rank, got {seen}"
        )
    wire = local.to(comm.comm_device(local)).contiguous()
    if wire.dtype == torch.bool:  # Gloo and Horovod move bytes, not bools
        wire = wire.to(torch.uint8)
    out = torch.cat(comm.all_gather_list(wire)).to(device=tensor.device, dtype=local.dtype)
    return out, [s[0] for s, _ in shapes]


def all_gather_object(comm: Collectives, obj: Any) -> list[Any]:
    """Every rank's ``obj`` (anything picklable), as a list indexed by rank."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    parts = comm.all_gather_list(payload.to(comm.comm_device(payload)))
    return [pickle.loads(part.cpu().numpy().tobytes()) for part in parts]


def gather_in_order(comm: Collectives, tensor: torch.Tensor, sampler: ShardedSampler) -> torch.Tensor:
    """The per-sample rows of one whole pass of ``sampler`` from every rank, in
    dataset order (row ``i`` is sample ``i``), the padding duplicates left out."""
    if not isinstance(sampler, ShardedSampler):
        raise ParallelxError(
            f"gather_in_order needs the parallelx ShardedSampler the loader drew from "
            f"(backend.make_sampler(dataset)), got {type(sampler).__name__}; with another "
            "sampler use backend.all_gather and order the rows yourself"
        )
    if (sampler.num_replicas, sampler.rank) != (comm.world_size, comm.rank):
        raise ParallelxError(
            f"gather_in_order: the sampler shards for rank {sampler.rank} of "
            f"{sampler.num_replicas}, but this is rank {comm.rank} of {comm.world_size}; "
            "build it with backend.make_sampler(dataset)"
        )
    index = sampler.dataset_index()
    gathered, counts = gather_rows(comm, tensor)
    if any(n != len(sampler) for n in counts):  # every rank sees the same counts: all raise
        raise ParallelxError(
            f"gather_in_order: each rank's shard has {len(sampler)} samples per pass, but the "
            f"ranks gave {counts} rows; give one row per sample of a whole pass (a loader "
            "with drop_last=True, or a pass cut short, leaves samples out)"
        )
    return gathered.index_select(0, index.to(gathered.device))
