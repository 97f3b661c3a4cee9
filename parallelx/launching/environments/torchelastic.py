"""``torchrun`` (torch.distributed.elastic): one agent per machine starts its workers.

An agent cut off from its rendezvous store (its machine left the network)
waits in a store call that has no time limit of its own: after a store
timeout, ``TCPStore`` cancels the wait and reads the cancellation's answer
with none, so the agent returns only when the network does or when TCP gives
up on the connection (``net.ipv4.tcp_retries2``: about 15 minutes).  With
restarts left that is what it should do (it continues once the machine is
back); on its last attempt the worker ends it (:meth:`after_network_loss`).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path

from parallelx.launching.environments.environment import ClusterEnvironment, World, distributed_world


class TorchElastic(ClusterEnvironment):
    name = "torchrun"
    default_backend = "ddp"
    priority = 30

    @classmethod
    def detect(cls, environ: Mapping[str, str], argv: Sequence[str]) -> bool:
        return "TORCHELASTIC_RUN_ID" in environ

    def __init__(self, environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None) -> None:
        super().__init__(environ, argv)
        #: The agent that started this worker, while it is still this process's parent.
        self._agent = os.getppid()

    def world(self) -> World:
        return distributed_world(self.environ, "LOCAL_WORLD_SIZE")

    def restarts_left(self) -> int:
        """How many more times this machine's agent restarts its workers after a failure."""
        try:
            return int(self.environ["TORCHELASTIC_MAX_RESTARTS"]) - int(self.environ["TORCHELASTIC_RESTART_COUNT"])
        except (KeyError, ValueError):
            return 0

    def after_network_loss(self, master_answers: bool) -> str:
        left = self.restarts_left()
        if left > 0:
            return (
                f"torchrun restarts the workers ({left} restart(s) left), which continue from the last checkpoint "
                "(--resume auto) once every machine is back"
            )
        then = "once it is back, run the same command with --resume auto to continue from the last checkpoint"
        if master_answers or not self._agent_is_parent():
            return then
        # The agent waits in a store call on MASTER_ADDR's machine (see the module's docstring).
        os.kill(self._agent, signal.SIGKILL)
        return (
            f"this was torchrun's last attempt, and its agent (pid {self._agent}), cut off from the rendezvous "
            f"store on that machine, would wait for TCP to give up (about 15 minutes): ended it; {then}"
        )

    def _agent_is_parent(self) -> bool:
        if os.getppid() != self._agent or self._agent <= 1:
            return False
        try:
            cmdline = Path(f"/proc/{self._agent}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            return False
        return b"torchrun" in cmdline or b"torch.distributed.run" in cmdline

    def why(self) -> str:
        return f"TORCHELASTIC_RUN_ID={self.environ['TORCHELASTIC_RUN_ID']}"
