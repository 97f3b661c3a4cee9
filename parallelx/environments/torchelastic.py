"""``torchrun`` (torch.distributed.elastic): one agent per machine starts its workers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .base import ClusterEnvironment, World, int_var


class TorchElastic(ClusterEnvironment):
    name = "torchrun"
    default_backend = "ddp"
    priority = 30

    @classmethod
    def detect(cls, environ: Mapping[str, str], argv: Sequence[str]) -> bool:
        return "TORCHELASTIC_RUN_ID" in environ

    def world(self) -> World:
        e = self.environ
        size = int_var(e, "WORLD_SIZE")
        return World(rank=int_var(e, "RANK"), world_size=size, local_rank=int_var(e, "LOCAL_RANK", default=0),
                     local_world_size=int_var(e, "LOCAL_WORLD_SIZE", default=size),
                     master_addr=e.get("MASTER_ADDR"), master_port=int_var(e, "MASTER_PORT", default=0) or None)

    def why(self) -> str:
        return f"TORCHELASTIC_RUN_ID={self.environ['TORCHELASTIC_RUN_ID']}"
