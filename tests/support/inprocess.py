"""What keeps the in-process tiers in-process."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest


def forbid_subprocesses(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Make any attempt to start a process fail the test, with where it belongs."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(
            "this tier runs in-process: a test that starts a subprocess belongs in tests/system/ "
            f"or tests/launcher/ (it ran {args[0] if args else kwargs.get('args')!r})"
        )

    monkeypatch.setattr(subprocess, "Popen", refuse)
    yield
