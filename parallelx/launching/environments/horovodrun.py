"""``horovodrun``: Horovod's launcher; ``hvd.init()`` reads its variables itself."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence

from parallelx.launching.environments.environment import ClusterEnvironment, World, int_var


class HorovodRun(ClusterEnvironment):
    name = "horovodrun"
    default_backend = "horovod"
    priority = 40

    @classmethod
    def detect(cls, environ: Mapping[str, str], argv: Sequence[str]) -> bool:
        return "HOROVOD_RANK" in environ

    def world(self) -> World:
        e = self.environ
        size = int_var(e, "HOROVOD_SIZE", default=1)
        return World(
            rank=int_var(e, "HOROVOD_RANK"),
            world_size=size,
            local_rank=int_var(e, "HOROVOD_LOCAL_RANK", default=0),
            local_world_size=int_var(e, "HOROVOD_LOCAL_SIZE", default=size),
        )

    def why(self) -> str:
        return f"HOROVOD_RANK={self.environ['HOROVOD_RANK']}"

    def export(self, environ: MutableMapping[str, str] | None = None) -> None:
        """Nothing: Horovod forms its world from its own variables, with no
        ``torch.distributed`` rendezvous."""
