"""A world given by plain variables: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``.

What Kubeflow's PyTorchJob sets for one process per pod, and what any other
launcher that speaks ``torch.distributed``'s ``env://`` leaves.  Without
``LOCAL_RANK`` the local rank is 0 and the machine holds one process: one
process per pod (or host) is what such a world means.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .base import ClusterEnvironment, World, int_var


class EnvVars(ClusterEnvironment):
    name = "env"
    default_backend = "ddp"
    priority = 10

    @classmethod
    def detect(cls, environ: Mapping[str, str], argv: Sequence[str]) -> bool:
        return "RANK" in environ and "WORLD_SIZE" in environ

    def world(self) -> World:
        e = self.environ
        size = int_var(e, "WORLD_SIZE")
        return World(rank=int_var(e, "RANK"), world_size=size, local_rank=int_var(e, "LOCAL_RANK", default=0),
                     local_world_size=int_var(e, "LOCAL_WORLD_SIZE", default=size if "LOCAL_RANK" in e else 1),
                     master_addr=e.get("MASTER_ADDR"), master_port=int_var(e, "MASTER_PORT", default=0) or None)

    def why(self) -> str:
        return f"RANK={self.environ['RANK']} WORLD_SIZE={self.environ['WORLD_SIZE']}"
