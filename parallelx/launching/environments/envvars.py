"""A world given by plain variables: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``.

What Kubeflow's PyTorchJob sets for one process per pod, and what any other
launcher that speaks ``torch.distributed``'s ``env://`` leaves.  Without
``LOCAL_RANK`` the local rank is 0 and the machine holds one process: one
process per pod (or host) is what such a world means.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from parallelx.launching.environments.environment import ClusterEnvironment, World, distributed_world


class EnvVars(ClusterEnvironment):
    name = "env"
    default_backend = "ddp"
    priority = 10

    @classmethod
    def detect(cls, environ: Mapping[str, str], argv: Sequence[str]) -> bool:
        return "RANK" in environ and "WORLD_SIZE" in environ

    def world(self) -> World:
        # Without LOCAL_RANK, one process per pod (or host): a machine of one.
        one = None if "LOCAL_RANK" in self.environ else 1
        return distributed_world(self.environ, "LOCAL_WORLD_SIZE", local_default=one)

    def why(self) -> str:
        return f"RANK={self.environ['RANK']} WORLD_SIZE={self.environ['WORLD_SIZE']}"
