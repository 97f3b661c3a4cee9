"""Ranks as threads of one process: the protocol's own multi-rank logic
(gathering's shape agreement, the loop's equal batch counts, metrics reduced
across ranks) over the smallest possible collectives, with no launcher."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from parallelx.backend import Backend
from parallelx.parts.collectives import Collectives


class Meeting:
    """Each rank's contribution, exchanged at a barrier."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world, timeout=20)
        self.slots: list[Any] = [None] * world

    def exchange(self, rank: int, value: Any) -> list[Any]:
        self.slots[rank] = value
        self.barrier.wait()
        seen = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before all have read it
        return seen


class ThreadCollectives(Collectives):
    """Collectives between thread-ranks."""

    def __init__(self, meeting: Meeting, rank: int) -> None:
        super().__init__(rank, len(meeting.slots))
        self.meeting = meeting

    def reduce_(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        parts = torch.stack(self.meeting.exchange(self.rank, tensor.clone()))
        return {"sum": parts.sum(0), "max": parts.amax(0), "min": parts.amin(0)}[op]

    def barrier(self) -> None:
        self.meeting.exchange(self.rank, None)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.meeting.exchange(self.rank, obj)[src]

    def all_gather_list(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [t.clone() for t in self.meeting.exchange(self.rank, tensor)]


class ThreadBackend(Backend):
    """A backend whose ranks are threads of this process."""

    name = "threads"

    def __init__(self, meeting: Meeting, rank: int, **options: Any) -> None:
        super().__init__(device="cpu", verbose=False, **options)
        self.meeting, self.thread_rank = meeting, rank

    def _init(self) -> None:
        self._rank = self.thread_rank  # not log.set_rank: that is per process
        self._world_size = len(self.meeting.slots)
        self.comm = ThreadCollectives(self.meeting, self.thread_rank)

    def init(self) -> ThreadBackend:  # no CPU-thread limits or atexit hooks for a thread
        self._init()
        self._initialized = True
        self.loop = self._make_loop()
        return self

    def _wrap_model(self, model: nn.Module) -> nn.Module:
        return model


def in_threads(world: int, body: Callable[[ThreadBackend], Any]) -> list[Any]:
    """Run ``body(backend)`` on ``world`` thread-ranks; their results by rank (an exception is re-raised)."""
    meeting = Meeting(world)
    results: list[Any] = [None] * world

    def run(rank: int) -> None:
        try:
            results[rank] = body(ThreadBackend(meeting, rank).init())
        except BaseException as exc:  # handed to the test below
            results[rank] = exc
            meeting.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, threading.BrokenBarrierError):
            raise r
    return results
