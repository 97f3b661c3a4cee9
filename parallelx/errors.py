"""Errors raised by parallelx.

Every error says what was wrong, what was expected, and what to do about it.
Command-line entry points catch :class:`ParallelxError` and print only its
message (no traceback), since it is always a usage or environment problem.
"""


class ParallelxError(RuntimeError):
    """Base class for all errors parallelx raises on purpose."""


class UnknownBackendError(ParallelxError, ValueError):
    """A backend name that is neither built in nor registered."""


class BackendUnavailableError(ParallelxError):
    """A known backend whose package is missing or unusable on this machine."""


class LaunchError(ParallelxError):
    """The process was started the wrong way for the backend asked for."""


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first two non-empty lines of ``exc``'s message, joined: enough to
    tell one failure from another in a one-line error (torch lists every
    mismatch of a state dict over many lines)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return " ".join(lines[:2])[:limit] if lines else type(exc).__name__
