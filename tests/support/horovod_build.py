"""Horovod's build, when ``make test`` runs it in the background (``scripts/setup.sh test``).

A fresh machine spends about 7 minutes building Horovod; the tests that need none of it run
meanwhile, and those that do (``needs_horovod``) go last and wait here for the build's
status (``$PARALLELX_HOROVOD_STATUS``: running, done or failed).  Without the variable (a plain
``pytest``, CI after ``make setup``) nothing waits."""

from __future__ import annotations

import inspect
import os
import time
from functools import cache
from pathlib import Path

import pytest

#: The longest a test waits for the build (it takes about 7 minutes on 2 cores alone).
WAIT_S = 1800.0


def status_file() -> Path | None:
    path = os.environ.get("PARALLELX_HOROVOD_STATUS")
    return Path(path) if path else None


def building() -> bool:
    """True when this run may find Horovod's build still under way (the order of the tests follows it)."""
    return status_file() is not None


@cache
def _module_source(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def needs_horovod(item: pytest.Item) -> bool:
    """A test runs Horovod when its id names it (a backend parameter) or its own code does."""
    if "horovod" in item.nodeid.lower():
        return True
    if item.nodeid.startswith(("tests/unit/", "tests/multirank/")):
        return False  # in this process: a backend's name, never a horovodrun launch
    function = getattr(item, "function", None)
    if function is None:
        return False
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        source = ""
    return "horovod" in source.lower() or "available_backends" in source


def wait(*, fail: bool = True) -> None:
    """Return once Horovod's build is done; fail the test with the build's log if it failed
    (``fail=False``: return then too, for a hook outside the test)."""
    path = status_file()
    if path is None:
        return
    deadline = time.monotonic() + WAIT_S
    while True:
        state = path.read_text().strip() if path.exists() else "done"
        if state == "done":
            return
        if state == "failed":
            if not fail:
                return
            log = path.with_name("horovod-build.log")
            tail = log.read_text()[-3000:] if log.exists() else "(no log)"
            pytest.fail(f"Horovod's background build failed (log: {log}):\n{tail}")
        if time.monotonic() > deadline:
            if not fail:
                return
            pytest.fail(f"Horovod's background build still runs after {WAIT_S:.0f}s ({path})")
        time.sleep(2.0)
