"""The ``deepspeed`` launcher: one ``pdsh``/local runner per machine, ``--local_rank`` in argv."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from parallelx.launching.environments.environment import ClusterEnvironment, World, distributed_world


class DeepSpeedLauncher(ClusterEnvironment):
    name = "deepspeed"
    default_backend = "deepspeed"
    priority = 35

    @classmethod
    def detect(cls, environ: Mapping[str, str], argv: Sequence[str]) -> bool:
        # CROSS_RANK is the launcher's own variable; --local_rank the argument it appends.
        launched = "CROSS_RANK" in environ or any(a.startswith(("--local_rank", "--local-rank")) for a in argv[1:])
        return launched and "RANK" in environ and "TORCHELASTIC_RUN_ID" not in environ

    def world(self) -> World:
        # LOCAL_SIZE is this launcher's name for the processes on the machine.
        return distributed_world(self.environ, "LOCAL_SIZE", "LOCAL_WORLD_SIZE")

    def why(self) -> str:
        return "CROSS_RANK set" if "CROSS_RANK" in self.environ else "--local_rank in argv"
