"""Tensor and sequence parallelism (``--tensor-parallel N``, ``--sequence-parallel``): a
plan (:mod:`.plan`) applied by a part (:mod:`.part`) that the engines consume: DDP over
the data-parallel group, FSDP2 over the data-parallel mesh (2D).  docs/tensor-parallel.md."""

from parallelx.tensor_parallel.part import ColwiseLinear, RowwiseLinear, TensorParallel
from parallelx.tensor_parallel.plan import Plan, find_plan

__all__ = ["ColwiseLinear", "Plan", "RowwiseLinear", "TensorParallel", "find_plan"]
