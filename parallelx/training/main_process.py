"""Work that one process does first, and logging from one process.

A dataset that is downloaded or preprocessed into a cache must be written
once, not by every rank at the same time::

    with parallelx.main_process_first(backend):        # rank 0 first, then the others
        train_set = torchvision.datasets.CIFAR10("data", download=True)

    with parallelx.local_main_process_first(backend):  # the first rank of each machine first
        tokenized = tokenize_into_cache(local_disk)

The main process runs the block while the others wait; once it is done the
others run it (and find the files there).  If the main process fails inside
the block, the others do not run it: they raise a :class:`ParallelxError`
naming the rank that failed, instead of repeating the failure or waiting for
a collective that never comes.  Every rank must enter the block (it holds one
collective).

:func:`get_logger` is a ``logging`` logger that writes on the main process
only, unless a call says ``main_process_only=False``::

    logger = parallelx.get_logger(__name__)
    logger.info("epoch %d: loss %.4f", epoch, loss)                 # rank 0 only
    logger.warning("shard is empty", main_process_only=False)       # every rank, its rank in front
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, MutableMapping
from typing import TYPE_CHECKING, Any

from parallelx import log
from parallelx.errors import ParallelxError

if TYPE_CHECKING:
    from parallelx.backend import Backend

__all__ = ["get_logger", "local_main_process_first", "main_process_first"]


@contextlib.contextmanager
def main_process_first(backend: Backend) -> Iterator[None]:
    """Run the block on the main process (global rank 0) first, then on every
    other rank.  Every rank must enter it."""
    with _first(backend, backend.is_main(), "the main process (rank 0)"):
        yield


@contextlib.contextmanager
def local_main_process_first(backend: Backend) -> Iterator[None]:
    """Run the block on the first process of each machine (local rank 0)
    first, then on the machine's other processes: for files on a disk that
    each machine has of its own.  Every rank must enter it."""
    with _first(backend, backend.local_rank == 0, "a local main process (local rank 0)"):
        yield


@contextlib.contextmanager
def _first(backend: Backend, first: bool, who: str) -> Iterator[None]:
    # One collective: the first processes join it after the block, the others
    # before it, and learn from it whether any first process failed.
    if first:
        try:
            yield
        except BaseException as exc:
            backend.all_gather_object(f"{type(exc).__name__}: {exc}".splitlines()[0])
            raise
        backend.all_gather_object(None)
        return
    failures = [(rank, error) for rank, error in enumerate(backend.all_gather_object(None)) if error is not None]
    if failures:
        rank, error = failures[0]
        raise ParallelxError(
            f"{who} failed in a main-process-first block, so rank {backend.rank} does not run it: rank {rank} "
            f"raised {error}; see rank {rank}'s output"
        )
    yield


class RankLogger(logging.LoggerAdapter[logging.Logger]):
    """A logger that writes on the main process only; ``main_process_only=False``
    in a call writes on every process (with ``[rank R]`` in front when the
    logger was given its backend)."""

    def __init__(self, logger: logging.Logger, backend: Backend | None = None) -> None:
        super().__init__(logger, {})
        self.backend = backend

    # The extra keyword is the point of this class (Accelerate's spelling); LoggerAdapter.log's named keywords pass through **kwargs.
    def log(  # type: ignore[override]
        self, level: int, msg: object, *args: Any, main_process_only: bool = True, **kwargs: Any
    ) -> None:
        main = self.backend.is_main() if self.backend is not None else log.is_main_process()
        if main_process_only and not main:
            return
        if not main_process_only and self.backend is not None:
            msg = f"[rank {self.backend.rank}] {msg}"
        if self.isEnabledFor(level):
            self.logger.log(level, msg, *args, **kwargs)

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return msg, kwargs


def get_logger(name: str, backend: Backend | None = None) -> RankLogger:
    """``logging.getLogger(name)``, writing on the main process only unless a
    call says ``main_process_only=False``.  The main process is ``backend``'s
    rank 0, or without a backend, rank 0 of the backend this process has
    initialised (before any, every process counts as its own main process:
    a logger made at import time works).  Configure handlers and levels
    with ``logging`` as usual."""
    return RankLogger(logging.getLogger(name), backend)
