"""The ``deepspeed`` launcher: one ``pdsh``/local runner per machine, ``--local_rank`` in argv."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .base import ClusterEnvironment, World, int_var


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
        e = self.environ
        size = int_var(e, "WORLD_SIZE")
        return World(rank=int_var(e, "RANK"), world_size=size, local_rank=int_var(e, "LOCAL_RANK", default=0),
                     # LOCAL_SIZE is this launcher's name for it.
                     local_world_size=int_var(e, "LOCAL_SIZE", "LOCAL_WORLD_SIZE", default=size),
                     master_addr=e.get("MASTER_ADDR"), master_port=int_var(e, "MASTER_PORT", default=0) or None)

    def why(self) -> str:
        return "CROSS_RANK set" if "CROSS_RANK" in self.environ else "--local_rank in argv"
