"""A tensor of which this rank holds one run of the flattened elements, as
``torch.distributed.checkpoint`` (DCP) writes and reads sharded tensors: the run cut into
boxes of the tensor's own shape, so that the checkpoint's index lists each tensor at its
own shape, readable by any DCP reader (plain ``dcp.load``, fsdp's slices, a world of one).

ZeRO keeps each rank's share of a parameter (and of its optimizer state) as such a run:
ZeRO-3 a ``1/world`` of every parameter, ZeRO 1 and 2 a range of each parameter group's
flat buffer, which cuts some parameters anywhere.  A run ``[start, stop)`` of a row-major
tensor is at most ``2 * ndim - 1`` boxes: the tail of a row, whole rows, the head of a row,
each cut the same way one dimension down.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch

#: offsets and sizes of one box, per dimension
Box = tuple[tuple[int, ...], tuple[int, ...]]


def boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """The boxes of the elements ``[start, stop)`` of a row-major tensor of ``shape``, in order; each
    box's elements are one contiguous run of the flattened tensor."""
    shape = tuple(shape)
    if stop <= start:
        return []
    if not shape:
        return [((), ())]
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    inner = 1
    for s in shape[1:]:
        inner *= s
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(stop, inner)
    if r0 == r1:  # within one row
        return [((r0, *o), (1, *s)) for o, s in boxes(shape[1:], c0, c1)]
    out: list[Box] = []
    if c0:  # the tail of the first row
        out += [((r0, *o), (1, *s)) for o, s in boxes(shape[1:], c0, inner)]
        r0 += 1
    if r1 > r0:
        out.append(((r0, *(0,) * (len(shape) - 1)), (r1 - r0, *shape[1:])))
    if c1:  # the head of the last row
        out += [((r1, *o), (1, *s)) for o, s in boxes(shape[1:], 0, c1)]
    return out


def chunked(run: torch.Tensor, shape: Sequence[int], start: int, every_rank: Sequence[tuple[int, int]]) -> torch.Tensor:
    """A ``ShardedTensor`` of global ``shape`` whose local shards are views of ``run`` (this rank's
    elements ``[start, start + run.numel())`` of the flattened tensor), given every rank's
    ``(start, stop)`` (the same on every rank: no collective here).  Saved by DCP, it writes only
    ``run``; loaded into, it fills ``run`` in place."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    device = run.device
    flat = run.reshape(-1)
    local = []
    at = 0
    for offsets, sizes in boxes(shape, start, start + flat.numel()):
        n = 1
        for s in sizes:
            n *= s
        placement = f"rank:{_rank()}/{device}"
        local.append(Shard(flat[at : at + n].view(sizes), ShardMetadata(list(offsets), list(sizes), placement)))
        at += n
    metas = [
        ShardMetadata(list(offsets), list(sizes), f"rank:{r}/{device}")
        for r, (a, b) in enumerate(every_rank)
        for offsets, sizes in boxes(shape, a, b)
    ]
    props = TensorProperties(
        dtype=run.dtype, layout=run.layout, requires_grad=False, memory_format=torch.contiguous_format, pin_memory=False
    )
    meta = ShardedTensorMetadata(metas, torch.Size(shape), props)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ShardedTensor's notice that DTensor is its successor
        return ShardedTensor._init_from_local_shards_and_global_metadata(local, meta)


def copied(tensor: torch.Tensor, copy: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``tensor`` with ``copy`` applied to it, or, a ``ShardedTensor``, to each of its local shards,
    its global layout kept (each placement's device now the copies': DCP reads only the offsets)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata

    if not isinstance(tensor, ShardedTensor):
        return copy(tensor)
    local = [(copy(s.tensor), s.metadata) for s in tensor.local_shards()]
    device = local[0][0].device if local else torch.device("cpu")

    def moved(m: ShardMetadata) -> ShardMetadata:
        assert m.placement is not None  # every shard of ours is placed on a rank
        return ShardMetadata(list(m.shard_offsets), list(m.shard_sizes), f"rank:{m.placement.rank()}/{device}")

    meta = tensor.metadata()
    shards = [Shard(t, moved(m)) for t, m in local]
    layout = ShardedTensorMetadata([moved(m) for m in meta.shards_metadata], meta.size, meta.tensor_properties)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ShardedTensor's notice that DTensor is its successor
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, layout)


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
