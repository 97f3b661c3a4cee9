"""main_process_first, local_main_process_first and get_logger in a world of
threads (each thread a rank; the one collective they use, all_gather_object,
meets at a barrier), and in a real world of one process."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import parallelx
from parallelx import ParallelxError

pytestmark = pytest.mark.timeout(60)


class ThreadRank:
    """What these helpers ask of a backend: the rank, the local rank, and all_gather_object."""

    def __init__(self, barrier: threading.Barrier, slots: list[Any], rank: int, local_world_size: int) -> None:
        self.barrier, self.slots = barrier, slots
        self.rank, self.world_size = rank, len(slots)
        self.local_rank = rank % local_world_size

    def is_main(self) -> bool:
        return self.rank == 0

    def all_gather_object(self, obj: Any) -> list[Any]:
        self.slots[self.rank] = obj
        self.barrier.wait()
        seen = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before all have read it
        return seen


def in_threads(world: int, body: Callable[[ThreadRank], Any], local_world_size: int | None = None) -> list[Any]:
    """``body(rank)`` on ``world`` thread-ranks; what each returned or raised, by rank."""
    barrier, slots = threading.Barrier(world, timeout=20), [None] * world
    results: list[Any] = [None] * world

    def run(rank: int) -> None:
        try:
            results[rank] = body(ThreadRank(barrier, slots, rank, local_world_size or world))
        except BaseException as exc:  # handed to the test
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank hangs"
    return results


def test_the_main_process_runs_the_block_before_every_other_rank():
    events: list[tuple[str, int]] = []
    lock = threading.Lock()

    def body(b: ThreadRank) -> int:
        if b.rank == 2:
            time.sleep(0.2)  # arrives last: the main process must not wait for it to start
        with parallelx.main_process_first(b):
            with lock:
                events.append(("start", b.rank))
            time.sleep(0.05)
            with lock:
                events.append(("end", b.rank))
        return b.rank

    assert in_threads(3, body) == [0, 1, 2]
    assert events[:2] == [("start", 0), ("end", 0)], events
    assert sorted(r for what, r in events if what == "start") == [0, 1, 2]


def test_the_local_main_processes_go_first_on_each_machine():
    starts: list[int] = []
    lock = threading.Lock()

    def body(b: ThreadRank) -> None:
        with parallelx.local_main_process_first(b), lock:
            starts.append(b.rank)

    in_threads(4, body, local_world_size=2)  # two machines of two: local ranks 0, 1, 0, 1
    assert sorted(starts[:2]) == [0, 2] and sorted(starts[2:]) == [1, 3], starts


def test_a_failure_of_the_main_process_stops_the_others_with_its_reason():
    ran: list[int] = []

    def body(b: ThreadRank) -> None:
        with parallelx.main_process_first(b):
            ran.append(b.rank)
            if b.rank == 0:
                raise OSError("download failed: connection reset")

    results = in_threads(3, body)
    assert ran == [0], "the others do not repeat the failing work"
    assert isinstance(results[0], OSError)
    for r in results[1:]:
        assert isinstance(r, ParallelxError)
        assert "rank 0 raised OSError: download failed: connection reset" in str(r), r


def test_a_world_of_one_runs_the_block_once():
    ran = []
    with parallelx.get_backend("single", device="cpu", verbose=False) as backend:
        with parallelx.main_process_first(backend):
            ran.append("main")
        with parallelx.local_main_process_first(backend):
            ran.append("local")
    assert ran == ["main", "local"]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []
        self.lock_ = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self.lock_:
            self.messages.append(record.getMessage())


def test_the_logger_writes_on_the_main_process_unless_told_otherwise():
    handler = _Records()
    base = logging.getLogger("parallelx-test-logger")
    base.addHandler(handler)
    base.setLevel(logging.INFO)
    try:

        def body(b: ThreadRank) -> None:
            logger = parallelx.get_logger("parallelx-test-logger", b)
            logger.info("epoch %d done", 3)
            logger.debug("below the level")
            logger.warning("empty shard", main_process_only=False)

        in_threads(2, body)
        assert sorted(handler.messages) == ["[rank 0] empty shard", "[rank 1] empty shard", "epoch 3 done"]
        handler.messages.clear()
        parallelx.get_logger("parallelx-test-logger").info("before any backend")  # its own main process
        assert handler.messages == ["before any backend"]
    finally:
        base.removeHandler(handler)
