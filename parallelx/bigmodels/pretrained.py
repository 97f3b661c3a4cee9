"""Pretrained weights straight into the shards: :func:`load_pretrained`.

    with parallelx.init_module():                 # or torch.device("meta"): the file gives every value
        model = GPT(config)
    parallelx.load_pretrained(model, "gpt2/")      # names, shapes and dtypes checked now, nothing read
    model, optimizer = backend.setup(model, optimizer)   # each rank reads the rows it keeps

Given a model on the meta device, the file is only opened: its names are matched and checked at
once, and each backend's set-up reads from it what it keeps (fsdp: each parameter's dim-0 rows of
this rank; ZeRO-3: the rows holding this rank's partition; the others: everything, once per
process).  Given a model that already has its weights (built eagerly, not yet set up), the file is
read into it at once.  Tensors the file does not hold (``strict=False``; a non-persistent buffer)
keep the values of their build.
"""

from __future__ import annotations

import dataclasses
import os

import torch
from torch import nn

from parallelx.bigmodels.formats import WeightFile, match_names, open_weights
from parallelx.bigmodels.meta import SOURCE, Slot, has_meta, model_tensors
from parallelx.errors import ParallelxError

__all__ = ["load_pretrained"]


@dataclasses.dataclass
class FileSource:
    """A weight file as the values of a meta model's tensors (:class:`parallelx.bigmodels.meta.Source`)."""

    file: WeightFile
    #: id of a model's tensor (a parameter keeps its identity when it gets its value) -> the file's name
    names: dict[int, str]

    def holds(self, slot: Slot) -> bool:
        return id(slot.tensor) in self.names

    def rows(
        self, slot: Slot, start: int | None, stop: int | None, columns: tuple[int, int] | None = None
    ) -> torch.Tensor:
        return self.file.rows(self.names[id(slot.tensor)], start, stop, columns)


def load_pretrained(model: nn.Module, path: str | os.PathLike[str] | WeightFile, *, strict: bool = True) -> WeightFile:
    """Load the weights at ``path`` (a ``torch.save`` state dict, a ``.safetensors`` file, or a Hugging
    Face model folder: sharded safetensors with ``model.safetensors.index.json``) into ``model``,
    before ``backend.setup``; returns the opened file (its ``bytes_read`` counts what was read).
    ``path`` may be a URL of an object store (``s3://bucket/model``): safetensors are read there by
    ranged reads, a slice at a time, as from a disk.

    A model on the meta device (``parallelx.init_module()`` or ``torch.device("meta")``) reads
    nothing now: set-up reads, on each rank, only the slices that rank keeps (fsdp, ZeRO-3).  Names
    are matched as the portable checkpoints match them (``_orig_mod.``, ``module.`` set aside); a
    tied tensor is found under any of its names.  Missing, unexpected and mis-shaped names are one
    ``ParallelxError`` naming them all; ``strict=False`` allows the first two.
    """
    file = path if isinstance(path, WeightFile) else open_weights(path)
    persistent = set(model.state_dict(keep_vars=True))
    slots = [
        s
        for s in model_tensors(model, only_meta=False)
        if any(n in persistent for n in s.names)  # a non-persistent buffer is never in a file
    ]
    table = {s.names[0]: (tuple(s.tensor.shape), s.names) for s in slots}
    matched = match_names(table, file)
    matched.check(strict=strict, where=str(path if not isinstance(path, WeightFile) else "the weights"))
    by_key = {s.names[0]: s for s in slots}
    if has_meta(model):
        if any(not s.tensor.is_meta for s in slots):
            raise ParallelxError(
                "load_pretrained: part of this model is on the meta device and part is not; build it whole "
                "under parallelx.init_module() (or torch.device('meta')), or whole eagerly"
            )
        model.__dict__[SOURCE] = FileSource(file, {id(by_key[k].tensor): v for k, v in matched.pairs.items()})
        return file
    if any(type(s.tensor) is not torch.Tensor and not isinstance(s.tensor, nn.Parameter) for s in slots):
        raise ParallelxError(
            "load_pretrained: this model is already set up (its tensors are sharded); call load_pretrained "
            "before backend.setup, or use backend.load_state_dict for a model already set up"
        )
    with torch.no_grad():
        for key, name in matched.pairs.items():
            by_key[key].tensor.copy_(file.rows(name))
    return file
