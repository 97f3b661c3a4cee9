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
