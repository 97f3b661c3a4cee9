"""Fixtures of the cluster-engine tests (test_slurm.py, test_ray.py): the data
and the torchrun reference run they share, made once per session on first use."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def engine_data(tmp_path_factory) -> Path:
    from engines import make_data

    return make_data(tmp_path_factory.mktemp("engine-cifar"))


@pytest.fixture(scope="session")
def engine_reference(engine_data, tmp_path_factory) -> Path:
    """The CIFAR-10 recipe's uninterrupted torchrun run that every engine's run must equal."""
    from engines import reference_run

    return reference_run(engine_data, tmp_path_factory.mktemp("engine-reference") / "out")
