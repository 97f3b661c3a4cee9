"""How many replica groups fsdp's hybrid sharding (HSDP) makes, from the option and the world
(in-process; the 4-process runs are ``tests/launcher/test_hsdp.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import parallelx
from backends.fsdp import FSDPStrategy
from parallelx.errors import ParallelxError


def groups(replicate: int | None, world: int, per_machine: int) -> int:
    joined = SimpleNamespace(world_size=world, local_world_size=per_machine)
    return FSDPStrategy(replicate=replicate).replica_groups(joined)  # type: ignore[arg-type]


def test_by_default_one_group_per_machine_and_none_on_one_machine() -> None:
    assert groups(None, 4, 4) == 1  # one machine: shard over every rank
    assert groups(None, 8, 4) == 2  # two machines of 4: each machine a group, sharded within it
    assert groups(None, 2, 1) == 1  # a process per machine: a group of one shard would be ddp; shard instead
    assert groups(None, 6, 4) == 1  # machines of different sizes: no even groups, plain sharding


def test_the_option_wins_and_a_size_that_does_not_divide_the_world_is_refused() -> None:
    assert groups(2, 4, 4) == 2 and groups(1, 8, 4) == 1 and groups(4, 4, 4) == 4
    with pytest.raises(ParallelxError, match="does not divide the world of 4 processes"):
        groups(3, 4, 4)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ParallelxError, match="replicate= takes a whole number"):
            FSDPStrategy(replicate=bad)  # type: ignore[arg-type]


def test_the_command_line_option_reaches_the_backend() -> None:
    import argparse

    p = argparse.ArgumentParser()
    parallelx.add_arguments(p)
    args = p.parse_args(["--backend", "fsdp", "--fsdp-replicate", "2"])
    assert FSDPStrategy.options_from_args(args)["replicate"] == 2
    assert FSDPStrategy.options_from_args(p.parse_args(["--backend", "fsdp"]))["replicate"] is None
