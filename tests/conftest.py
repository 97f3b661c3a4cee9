"""Shared by every tier.  The tiers are the folders: unit/ and multirank/ run
in this process (no subprocess: ``make test-fast``), launcher/ under the real
launchers, system/ whole scenarios (faults, restarts, the CLI, benchmarks)."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The launch helpers and the workers the launcher tests start.
sys.path.insert(0, str(ROOT / "tests" / "support"))

# Variables that a launcher (or a backend's world-of-one fallback) sets.
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HOROVOD_RANK")


@pytest.fixture(autouse=True)
def _no_env_leak():
    """In-process tests must not leave launcher variables behind: the next
    test would think it runs under a launcher."""
    before = {k: os.environ.get(k) for k in _LAUNCH_VARS}
    yield
    leaked = {k: os.environ.get(k) for k in _LAUNCH_VARS if os.environ.get(k) != before[k]}
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    assert not leaked, f"test leaked environment variables: {leaked}"
