"""Each parameter's share on this rank under ``fsdp`` and DeepSpeed's ZeRO-3
(:class:`parallelx.parts.shards.ParameterShards`): what a weight average keeps
beside a sharded model, so that it is as sharded as the model.

- ``fsdp`` (FSDP2): every parameter is a DTensor whose local tensor is this
  rank's dim-0 slice, the storage the next forward's all-gather reads.
- ZeRO-3: every parameter's ``ds_tensor`` is this rank's flat partition
  (padded on the last ranks), the storage the next forward gathers; small
  parameters that DeepSpeed keeps gathered between forwards
  (``stage3_param_persistence_threshold``) are refreshed from the partitions
  after a write.

Not a backend (the leading underscore): the registry names its modules explicitly.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from parallelx.parts.shards import ParameterShards
from parallelx.parts.stateio import plain_key
from parallelx.utils import lazy_module

# DTensor and DCP's metadata come with it: loaded where fsdp runs, never at import (parallelx.add_arguments).
fsdp_state = lazy_module(f"{__package__}._fsdp_state")


class DTensorShards(ParameterShards):
    """FSDP2's parameters: this rank's dim-0 slice of each DTensor (a plain parameter stays whole)."""

    sharded = True

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self.params = {plain_key(n): p for n, p in module.named_parameters()}

    def local(self) -> dict[str, torch.Tensor]:
        from torch.distributed.tensor import DTensor  # here: importing the backends must not load DTensor

        with torch.no_grad():
            return {n: p.to_local() if isinstance(p, DTensor) else p.detach() for n, p in self.params.items()}

    def gather(self, shards: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from torch.distributed.tensor import DTensor

        whole = {}
        for name, shard in shards.items():  # one tensor at a time: at most one whole tensor on a device
            p = self.params[name]
            if isinstance(p, DTensor):
                t = DTensor.from_local(
                    shard, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )
                whole[name] = t.full_tensor().detach().to("cpu", copy=True)
            else:
                whole[name] = shard.detach().to("cpu", copy=True)
        return whole

    def scatter(self, whole: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from torch.distributed.tensor import DTensor

        out = {}
        for name, p in self.params.items():
            cut = fsdp_state.like(whole[name], p.detach())
            out[name] = (cut.to_local() if isinstance(cut, DTensor) else cut).clone()
        return out

    def written(self) -> None:
        # A module's forward outside training (the root's, which fully_shard does not reshard after
        # forward) may have left whole copies that the next forward reuses instead of gathering.
        from torch.distributed.fsdp import FSDPModule

        for m in self.module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


class ZeroShards(ParameterShards):
    """ZeRO-3's parameters: this rank's flat partition of each (``ds_tensor``)."""

    sharded = True

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self.params = {plain_key(n): p for n, p in module.named_parameters()}

    def local(self) -> dict[str, torch.Tensor]:
        return {n: p.ds_tensor.detach() for n, p in self.params.items()}  # type: ignore[attr-defined]

    def _whole(self, p: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
        group = p.ds_process_group  # type: ignore[attr-defined]
        pieces = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, shard.contiguous(), group=group)
        numel = p.ds_numel  # type: ignore[attr-defined]
        return torch.cat(pieces)[:numel].view(p.ds_shape)  # type: ignore[attr-defined]

    def gather(self, shards: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: self._whole(self.params[n], s).to("cpu", copy=True) for n, s in shards.items()}

    def scatter(self, whole: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in self.params.items():
            part = p.ds_tensor  # type: ignore[attr-defined]
            rank = dist.get_rank(p.ds_process_group)  # type: ignore[attr-defined]
            flat = whole[name].detach().reshape(-1).to(part.device, part.dtype)
            padded = torch.zeros(part.numel() * dist.get_world_size(p.ds_process_group), dtype=part.dtype)  # type: ignore[attr-defined]
            padded = padded.to(part.device)
            padded[: flat.numel()] = flat
            out[name] = padded[rank * part.numel() : (rank + 1) * part.numel()].clone()
        return out

    def written(self) -> None:
        # Parameters held gathered between forwards (persistent ones) are not gathered again from
        # their partitions: their whole copies take the new values here (the same on every rank).
        with torch.no_grad():
            for p in self.params.values():
                if p.data.numel() == p.ds_numel:  # type: ignore[attr-defined]
                    p.data.copy_(self._whole(p, p.ds_tensor.detach()).to(p.data.device, p.data.dtype))  # type: ignore[attr-defined]
