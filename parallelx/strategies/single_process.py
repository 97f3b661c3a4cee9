"""World-of-one behaviour, for the backends that run in a single process
(``single``, ``dp``): their collectives are :class:`parallelx.parts.collectives.LocalCollectives`,
which have nothing to exchange."""

from __future__ import annotations

import torch

from parallelx.log import warn
from parallelx.parts.collectives import LocalCollectives
from parallelx.parts.loop import LoopOptions
from parallelx.strategy import Joined, Strategy

__all__ = ["LocalCollectives", "SingleProcessStrategy"]


class SingleProcessStrategy(Strategy):
    """A backend whose whole job is this one process."""

    def join(self) -> Joined:
        return self.world_of_one(self.run.pick_device(0))

    @staticmethod
    def world_of_one(device: torch.device) -> Joined:
        return Joined(rank=0, world_size=1, local_rank=0, local_world_size=1, device=device, comm=LocalCollectives())

    def configure(self, options: LoopOptions) -> LoopOptions:
        if options.grad_compression != "none":
            warn(
                f"{self.name}: --grad-compression {options.grad_compression} has no effect: one process sends "
                "no gradients anywhere"
            )
        return options
