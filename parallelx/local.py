"""World-of-one behaviour, for the backends that run in a single process
(``single``, ``dp``): collectives have nothing to exchange."""

from __future__ import annotations

from typing import TypeVar

import torch

from .errors import ParallelxError
from .log import warn
from .loop import LoopOptions
from .protocol import Backend

T = TypeVar("T")


class LocalBackend(Backend):
    """A backend whose whole job is this one process."""

    def _reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        return tensor

    def _check_options(self, options: LoopOptions) -> None:
        if options.grad_compression != "none":
            warn(
                f"{self.name}: --grad-compression {options.grad_compression} has no effect: one process sends "
                "no gradients anywhere"
            )

    def barrier(self) -> None:
        self._require_init()

    def broadcast(self, obj: T, src: int = 0) -> T:
        self._require_init()
        if src != 0:
            raise ParallelxError(f"broadcast from rank {src} in a world of 1 process (only rank 0 exists)")
        return obj

    def _all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor.clone()]
