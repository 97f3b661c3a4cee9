"""Each parameter's share on this rank: what a weight average (:class:`parallelx.EMA`) keeps beside a model.

A backend that keeps every parameter whole on every rank hands out the
parameters themselves; one that shards them (``fsdp``'s DTensors, ZeRO-3's
partitions) gives a subclass whose :meth:`ParameterShards.local` are this
rank's slices, so that whatever is kept per parameter is as sharded as the
model and elementwise arithmetic on it needs no communication.  Whole
tensors are put together only when asked (:meth:`ParameterShards.gather`,
a collective: a checkpoint) and cut back locally (:meth:`ParameterShards.scatter`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from parallelx.parts.stateio import plain_key


class ParameterShards:
    """The parameters of ``module`` (the user's module, unwrapped) as this rank holds them: here, whole."""

    #: True where :meth:`local` holds slices rather than whole tensors.
    sharded = False

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def local(self) -> dict[str, torch.Tensor]:
        """Each parameter's live tensor on this rank, by plain name (writing into one changes the model)."""
        return {plain_key(n): p.detach() for n, p in self.module.named_parameters()}

    def gather(self, shards: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole CPU tensors from tensors laid out as :meth:`local` (a collective where sharded)."""
        return {n: t.detach().to("cpu", copy=True) for n, t in shards.items()}

    def scatter(self, whole: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's part of whole tensors, laid out as :meth:`local` (cut locally, no communication)."""
        live = self.local()
        return {n: whole[n].to(live[n].device, live[n].dtype, copy=True) for n in live}

    def written(self) -> None:
        """Called after :meth:`local` tensors were written into, before the next forward: a backend
        that keeps whole copies of some parameters besides their shards refreshes them here."""
