"""``torchrun`` (torch.distributed.elastic): one agent per machine starts its workers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .base import ClusterEnvironment, World, distributed_world


class TorchElastic(ClusterEnvironment):
    name = "torchrun"
    default_backend = "ddp"
    priority = 30

    @classmethod
    def detect(cls, environ: Mapping[str, str], argv: Sequence[str]) -> bool:
        return "TORCHELASTIC_RUN_ID" in environ

    def world(self) -> World:
        return distributed_world(self.environ, "LOCAL_WORLD_SIZE")

    def why(self) -> str:
        return f"TORCHELASTIC_RUN_ID={self.environ['TORCHELASTIC_RUN_ID']}"
