"""Ranks as threads of one process: the protocol's own multi-rank logic
(gathering's shape agreement, the loop's equal batch counts, metrics reduced
across ranks) over the smallest possible collectives, with no launcher."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from parallelx.backend import Backend
from parallelx.forensics.exchange import ENABLE_ENV
from parallelx.launching.environments import detect_environment
from parallelx.parts.collectives import Collectives
from parallelx.strategy import BackendSpec, Joined, Options, Strategy


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


class ThreadStrategy(Strategy):
    """A backend whose ranks are threads of this process."""

    spec = BackendSpec(name="threads")

    def __init__(self, meeting: Meeting, rank: int) -> None:
        self.meeting, self.thread_rank = meeting, rank

    def join(self) -> Joined:
        world = len(self.meeting.slots)
        comm = ThreadCollectives(self.meeting, self.thread_rank)
        return Joined(self.thread_rank, world, self.thread_rank, world, torch.device("cpu"), comm)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model


def ThreadBackend(meeting: Meeting, rank: int, **options: Any) -> Backend:
    """The facade over a :class:`ThreadStrategy`: rank ``rank`` of ``meeting``'s world.
    Initialise it inside :func:`no_forensics`."""
    return Backend(ThreadStrategy(meeting, rank), Options(device="cpu", verbose=False, environment=THREADS, **options))


#: No launcher: the ranks are this process's threads.
THREADS = detect_environment({}, [])


@contextlib.contextmanager
def no_forensics() -> Iterator[None]:
    """The hang forensics is one per process (parallelx.forensics): thread-ranks
    would each start a store of their own and leave all but the last running."""
    before = os.environ.get(ENABLE_ENV)
    os.environ[ENABLE_ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENABLE_ENV, None)
        else:
            os.environ[ENABLE_ENV] = before


def in_threads(world: int, body: Callable[[Backend], Any]) -> list[Any]:
    """Run ``body(backend)`` on ``world`` thread-ranks; their results by rank (an exception is re-raised)."""
    meeting = Meeting(world)
    results: list[Any] = [None] * world

    def run(rank: int) -> None:
        try:
            # Closed as a script's `with` closes it: a backend left open kept its
            # rank in parallelx.log and its atexit hook, and silenced the next test.
            with ThreadBackend(meeting, rank) as backend:
                results[rank] = body(backend)
        except BaseException as exc:  # handed to the test below
            results[rank] = exc
            meeting.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    with no_forensics():
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, threading.BrokenBarrierError):
            raise r
    return results
