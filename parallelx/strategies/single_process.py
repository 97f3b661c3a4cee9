"""World-of-one behaviour, for the backends that run in a single process
(``single``, ``dp``): their collectives are :class:`parallelx.parts.collectives.LocalCollectives`,
which have nothing to exchange."""

from __future__ import annotations

from parallelx.backend import Backend
from parallelx.log import warn
from parallelx.parts.collectives import LocalCollectives
from parallelx.parts.loop import LoopOptions

__all__ = ["LocalBackend", "LocalCollectives"]


class LocalBackend(Backend):
    """A backend whose whole job is this one process."""

    def _check_options(self, options: LoopOptions) -> None:
        if options.grad_compression != "none":
            warn(
                f"{self.name}: --grad-compression {options.grad_compression} has no effect: one process sends "
                "no gradients anywhere"
            )
