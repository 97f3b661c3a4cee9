"""One warning path for the whole job: printed once, by one process.

Every rank runs the same code, so a naive ``print`` of a warning appears once
per rank.  :func:`warn` prints only on the main rank (or before any backend is
initialised, when each process is still its own world) and only the first
time a message is seen in this process.
"""

from __future__ import annotations

import sys

_rank: int | None = None
_seen: set[str] = set()


def set_rank(rank: int | None) -> None:
    """Called by a backend once it knows this process's global rank."""
    global _rank
    _rank = rank


def is_main_process() -> bool:
    """True on global rank 0, and in every process before a backend is initialised."""
    return _rank in (None, 0)


def warn(msg: str, *, once: bool = True) -> None:
    """``parallelx: warning: msg`` on stderr, on the main rank only, once per message."""
    if not is_main_process():
        return
    if once:
        if msg in _seen:
            return
        _seen.add(msg)
    print(f"parallelx: warning: {msg}", file=sys.stderr, flush=True)


def info(msg: str) -> None:
    """``msg`` on stdout, on the main rank only."""
    if is_main_process():
        print(msg, flush=True)
