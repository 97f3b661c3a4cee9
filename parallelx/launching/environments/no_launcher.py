"""No launcher: this process is the whole job (a world of one)."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence

import torch

from parallelx.launching.environments.environment import ClusterEnvironment, World


class Local(ClusterEnvironment):
    name = "local"
    default_backend = "single"
    priority = -1  # the fallback

    @classmethod
    def detect(cls, environ: Mapping[str, str], argv: Sequence[str]) -> bool:
        return True

    @classmethod
    def auto_backend(cls) -> str:
        # One process driving several GPUs is DataParallel's case.
        return "dp" if torch.cuda.is_available() and torch.cuda.device_count() > 1 else "single"

    def world(self) -> World:
        return World()

    def why(self) -> str:
        return "no launcher's variables are set"

    def export(self, environ: MutableMapping[str, str] | None = None) -> None:
        """Nothing: a backend that needs a rendezvous for its world of one makes its own."""
