"""Cluster environments: detection, the world each reads, the backend each
means, a backend refusing one it cannot run in, and a process group that an
environment made being adopted and left alone.  In-process, no launcher."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import parallelx
from parallelx.environments import (ClusterEnvironment, World, available_environments, detect_environment,
                                    environment_class, register_environment)
from parallelx.errors import LaunchError, ParallelxError
from parallelx.launch import free_port

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "host0", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "job"}
DEEPSPEED = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_SIZE": "2", "CROSS_RANK": "0",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
HOROVOD = {"HOROVOD_RANK": "2", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "2"}
PYTORCHJOB = {"RANK": "5", "WORLD_SIZE": "8", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}


@pytest.mark.parametrize("environ,argv,name,world,backend", [
    (TORCHRUN, ["t.py"], "torchrun", World(3, 4, 1, 2, "host0", 29400), "ddp"),
    (DEEPSPEED, ["t.py", "--local_rank=1"], "deepspeed", World(1, 2, 1, 2, "127.0.0.1", 29500), "deepspeed"),
    (HOROVOD, ["t.py"], "horovodrun", World(2, 4, 0, 2), "horovod"),
    # One process per pod: no LOCAL_RANK, so local rank 0 of 1.
    (PYTORCHJOB, ["t.py"], "env", World(5, 8, 0, 1, "job-master-0", 23456), "ddp"),
    ({}, ["t.py"], "local", World(), "single"),
])
def test_each_environment_is_detected_with_its_world(environ, argv, name, world, backend):
    env = detect_environment(environ, argv)
    assert env.name == name and env.world() == world and env.why()
    if backend == "single" and torch.cuda.device_count() > 1:
        backend = "dp"
    assert parallelx.detect_backend(environ, argv) == backend


def test_the_deepspeed_launcher_under_torchrun_is_torchrun():
    # torchrun also passes --local-rank to some scripts: its own variable decides.
    env = detect_environment({**TORCHRUN, "CROSS_RANK": "0"}, ["t.py", "--local_rank=1"])
    assert env.name == "torchrun"


def test_export_fills_only_what_is_missing():
    target = {"MASTER_PORT": "1"}
    detect_environment(PYTORCHJOB, ["t.py"]).export(target)
    assert target == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                      "MASTER_ADDR": "job-master-0", "MASTER_PORT": "1"}
    target = {}
    detect_environment(HOROVOD, ["t.py"]).export(target)
    assert target == {}, "horovod forms its world from its own variables"


def test_a_bad_variable_is_one_clear_error():
    with pytest.raises(LaunchError, match=r"\$RANK must be an integer, got 'x'"):
        detect_environment({**PYTORCHJOB, "RANK": "x"}, ["t.py"]).world()


def test_a_backend_refuses_an_environment_it_cannot_run_in():
    backend = parallelx.get_backend("ddp", environment=environment_class("horovodrun")(HOROVOD, ["t.py"]))
    with pytest.raises(LaunchError, match="ddp cannot form its world under horovodrun .*HOROVOD_RANK=2.*torchrun"):
        backend.init()
    assert not backend.initialized
    backend = parallelx.get_backend("deepspeed", environment=environment_class("local")({}, ["t.py"]))
    with pytest.raises(LaunchError, match="deepspeed cannot form its world under local .*deepspeed --num_gpus"):
        backend.init()


def test_environments_register_and_are_tried_by_priority():
    class Scheduler(ClusterEnvironment):
        name = "scheduler-test"
        default_backend = "ddp"
        priority = 50

        @classmethod
        def detect(cls, environ, argv):
            return "SCHED_TASK" in environ

        def world(self):
            return World(int(self.environ["SCHED_TASK"]), 2, 0, 1, "127.0.0.1", 1234)

    register_environment(Scheduler)
    try:
        assert available_environments()[0] == "scheduler-test"
        env = detect_environment({"SCHED_TASK": "1", **HOROVOD}, ["t.py"])
        assert env.name == "scheduler-test" and env.world().rank == 1
        assert parallelx.detect_backend({"SCHED_TASK": "1"}, ["t.py"]) == "ddp"
    finally:
        from parallelx import environments

        environments._ENVIRONMENTS.pop("scheduler-test")
    with pytest.raises(ParallelxError, match="named ClusterEnvironment subclass"):
        register_environment(int)  # type: ignore[arg-type]


class _Owner(ClusterEnvironment):
    """An environment that made the process group before the script ran (as Ray Train does)."""

    name = "env"
    owns_process_group = True

    @classmethod
    def detect(cls, environ, argv):
        return False

    def world(self):
        return World(0, 1, 0, 1, "127.0.0.1", int(os.environ.get("MASTER_PORT", "0")) or None)


def test_a_process_group_made_by_the_environment_is_adopted_and_left_to_it(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "unset")  # ddp's world of one sets them: restored afterwards
        monkeypatch.delenv(key)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with parallelx.get_backend("ddp", environment=_Owner({}, ["t.py"])) as backend:
            assert backend.world_size == 1
            assert float(backend.all_reduce(torch.ones(1))) == 1.0
        assert dist.is_initialized(), "the backend destroyed a process group it did not make"
    finally:
        dist.destroy_process_group()
    with parallelx.get_backend("ddp") as backend:  # no launcher: its own group, destroyed at the end
        assert dist.is_initialized()
    assert not dist.is_initialized()
