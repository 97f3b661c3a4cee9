"""Cluster environments: detection, the world each reads, the backend each
means, a backend refusing one it cannot run in, and a process group that an
environment made being adopted and left alone.  In-process, no launcher."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import parallelx
from parallelx.errors import LaunchError, ParallelxError
from parallelx.launching.environments import (
    ClusterEnvironment,
    World,
    available_environments,
    detect_environment,
    environment_class,
    register_environment,
)
from parallelx.launching.environments.slurm import Slurm, derived_port, expand_hostlist, expand_tasks_per_node
from parallelx.launching.launchers import free_port

TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "host0",
    "MASTER_PORT": "29400",
    "TORCHELASTIC_RUN_ID": "job",
}
DEEPSPEED = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "LOCAL_SIZE": "2",
    "CROSS_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}
HOROVOD = {"HOROVOD_RANK": "2", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "2"}
PYTORCHJOB = {"RANK": "5", "WORLD_SIZE": "8", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}


@pytest.mark.parametrize(
    "environ,argv,name,world,backend",
    [
        (TORCHRUN, ["t.py"], "torchrun", World(3, 4, 1, 2, "host0", 29400), "ddp"),
        (DEEPSPEED, ["t.py", "--local_rank=1"], "deepspeed", World(1, 2, 1, 2, "127.0.0.1", 29500), "deepspeed"),
        (HOROVOD, ["t.py"], "horovodrun", World(2, 4, 0, 2), "horovod"),
        # One process per pod: no LOCAL_RANK, so local rank 0 of 1.
        (PYTORCHJOB, ["t.py"], "env", World(5, 8, 0, 1, "job-master-0", 23456), "ddp"),
        ({}, ["t.py"], "local", World(), "single"),
    ],
)
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
    assert target == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "job-master-0",
        "MASTER_PORT": "1",
    }
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
        priority = 60

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
        from parallelx.launching import environments

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


# ------------------------------------------------------------------ Slurm

#: Rank 1 of an ``srun --ntasks-per-node 2 -N 2`` step, as srun sets it (seen on Slurm 22.05).
SRUN = {
    "SLURM_JOB_ID": "1234",
    "SLURM_JOBID": "1234",
    "SLURM_STEP_ID": "0",
    "SLURM_STEPID": "0",
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_NODELIST": "node[07-08]",
    "SLURM_JOB_NODELIST": "node[07-08]",
    "SLURM_NNODES": "2",
}


@pytest.mark.parametrize(
    "text,hosts",
    [
        ("localhost", ["localhost"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a[1-2],b3", ["a1", "a2", "b3"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),  # the width of the first number
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("gpu-[1-2]-ib,cpu[5]", ["gpu-1-ib", "gpu-2-ib", "cpu5"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),  # several groups: the product, in order
        ("a,b,c", ["a", "b", "c"]),
        (" node[1-2] ", ["node1", "node2"]),
    ],
)
def test_slurm_host_lists_expand(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(
    "text,why",
    [
        ("node[1-", "'\\[' without '\\]'"),
        ("node1]", "'\\]' without '\\['"),
        ("n[a-b]", "not a number"),
        ("n[3-1]", "runs backwards"),
        ("a,,b", "empty host name"),
        ("n[1-2[3]]", "nested"),
        ("n[1-]", "not a number"),
    ],
)
def test_a_malformed_host_list_is_one_error_naming_it(text, why):
    with pytest.raises(LaunchError, match=f"Slurm host list .*{why}"):
        expand_hostlist(text)


def test_slurm_tasks_per_node_expand():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    assert expand_tasks_per_node("1,3(x2)") == [1, 3, 3]
    with pytest.raises(LaunchError, match=r"'2x3' is not N or N\(xK\)"):
        expand_tasks_per_node("2x3")


def test_srun_tasks_are_one_rank_each():
    env = detect_environment(SRUN, ["t.py"])
    assert env.name == "slurm" and "SLURM_PROCID=3 of 4 tasks, job 1234 step 0" in env.why()
    assert env.world() == World(3, 4, 1, 2, "node07", derived_port(1234, 0))
    assert parallelx.detect_backend(SRUN, ["t.py"]) == "ddp", "--backend auto under srun: ddp, not a world of one"
    given = detect_environment({**SRUN, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29555"}, ["t.py"]).world()
    assert (given.master_addr, given.master_port) == ("10.0.0.1", 29555)
    # The node's own count: the last node of "2(x3),1" holds one task.
    last = {
        **SRUN,
        "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
        "SLURM_NODEID": "3",
        "SLURM_LOCALID": "0",
        "SLURM_PROCID": "6",
        "SLURM_STEP_NUM_TASKS": "7",
        "SLURM_STEP_NODELIST": "a[1-3],b1",
    }
    assert detect_environment(last, ["t.py"]).world() == World(6, 7, 0, 1, "a1", derived_port(1234, 0))
    target: dict[str, str] = {}
    env.export(target)
    assert target == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "node07",
        "MASTER_PORT": str(derived_port(1234, 0)),
    }


def test_the_derived_port_is_per_job_and_step_and_below_the_ephemeral_range():
    ports = {derived_port(job, step) for job in range(1000, 1100) for step in range(3)}
    assert len(ports) == 300 and all(20000 <= p < 30000 for p in ports)
    assert derived_port(5, 0) == derived_port(5, 0)


@pytest.mark.parametrize(
    "environ",
    [
        # salloc, then python train.py: a job but no step, no task id.
        {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "localhost", "SLURM_NNODES": "1"},
        # The batch script itself (sbatch -n 2): task 0, but of no step.
        {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODELIST": "a1"},
        # A step of one task (srun python train.py in a one-task allocation).
        {**SRUN, "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1"},
    ],
)
def test_a_process_of_no_step_or_alone_in_its_step_is_a_world_of_one(environ):
    env = detect_environment(environ, ["t.py"])
    assert env.name == "local" and env.world() == World()


@pytest.mark.parametrize("launcher,name", [(TORCHRUN, "torchrun"), (DEEPSPEED, "deepspeed"), (HOROVOD, "horovodrun")])
def test_a_launcher_inside_a_slurm_step_describes_the_world(launcher, name):
    # One task per node running torchrun (or the deepspeed launcher, horovodrun): its workers inherit the step's
    # variables, but the launcher's own say where each worker stands.
    one_task = {**SRUN, "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    argv = ["t.py", "--local_rank=1"] if name == "deepspeed" else ["t.py"]
    assert detect_environment({**one_task, **launcher}, argv).name == name


def test_more_tasks_per_node_than_gpus_is_one_line_naming_the_numbers():
    env = detect_environment({**SRUN, "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}, ["t.py"])
    with pytest.raises(LaunchError, match="runs 4 tasks on this node but each task sees 2 GPU") as info:
        env.check_devices(2)
    assert "\n" not in str(info.value)
    env.check_devices(0)  # the CPU: any number of tasks
    env.check_devices(4)


@pytest.mark.skipif(
    parallelx.describe("horovod").unavailable_reason() is not None,
    reason="Horovod is not installed here (make test's set-up leaves out its build; make setup builds it)",
)
def test_horovod_under_srun_says_how_to_launch_it_instead():
    backend = parallelx.get_backend("horovod", environment=Slurm(SRUN, ["t.py"]))
    with pytest.raises(LaunchError) as info:
        backend.init()
    message = str(info.value)
    assert "horovod cannot form its world under slurm" in message and "horovodrun -np N" in message
    assert "once per job, not in every task" in message and "node07:2,node08:2" in message
    assert "\n" not in message and not backend.initialized


# ------------------------------------------------------- Kubernetes, plain variables
@pytest.mark.parametrize(
    "extra,world",
    [
        # PyTorchJob, one process per pod: PET_* are torchrun's defaults, which this process was not started by.
        (
            {"PET_NPROC_PER_NODE": "1", "PET_NNODES": "8", "PET_NODE_RANK": "5"},
            World(5, 8, 0, 1, "job-master-0", 23456),
        ),
        # Several processes per pod from another launcher that says where each stands.
        ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, World(5, 8, 1, 4, "job-master-0", 23456)),
    ],
)
def test_plain_variables_give_the_local_rank_sensibly(extra, world):
    env = detect_environment({**PYTORCHJOB, **extra}, ["t.py"])
    assert env.name == "env" and env.world() == world


# ----------------------------------------------------------------- Ray Train
class _RayContext:
    def __init__(self, rank: int, size: int = 2) -> None:
        self.rank, self.size = rank, size

    def get_world_rank(self):
        return self.rank

    def get_world_size(self):
        return self.size

    def get_local_rank(self):
        return self.rank

    def get_local_world_size(self):
        return self.size


@pytest.fixture
def ray_worker(monkeypatch):
    """A fake Ray Train worker: the context, and ``ray.train``'s report and get_checkpoint."""
    import sys
    import types

    from parallelx.launching.environments import ray_worker as ray_env

    calls: dict[str, list] = {"report": [], "restored": []}
    train = types.SimpleNamespace(
        report=lambda metrics, checkpoint=None: calls["report"].append((metrics, checkpoint)),
        Checkpoint=types.SimpleNamespace(from_directory=lambda d: f"ckpt:{d}"),
        get_checkpoint=lambda: calls["restored"][-1] if calls["restored"] else None,
    )
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(train=train))
    monkeypatch.setitem(sys.modules, "ray.train", train)
    context = _RayContext(1)
    monkeypatch.setattr(ray_env, "_train_context", lambda: context)
    return context, calls


RAY = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "NODE_RANK": "0",
    "MASTER_ADDR": "10.1.2.3",
    "MASTER_PORT": "41000",
}


def test_a_ray_train_worker_is_ray_before_torchrun_and_owns_its_group(ray_worker, tmp_path):
    context, calls = ray_worker
    env = detect_environment({**RAY, "TORCHELASTIC_RUN_ID": "x"}, ["t.py"])
    assert env.name == "ray" and env.owns_process_group and "world rank 1 of 2" in env.why()
    assert env.world() == World(1, 2, 1, 2, "10.1.2.3", 41000)
    assert parallelx.detect_backend(RAY, ["t.py"]) == "ddp"
    target: dict[str, str] = {}
    env.export(target)
    assert target == {}, "Ray set the variables and made the group"
    for backend in ("ddp", "deepspeed", "fsdp"):
        assert {"ray", "slurm"} <= set(parallelx.describe(backend).environments or ())
    assert "ray" not in (parallelx.describe("horovod").environments or ()), "Ray has dropped Horovod"
    # Every rank reports each checkpoint; rank 0 with the directory.
    env.checkpoint_saved(tmp_path / "step-00000002", 2)
    context.rank = 0
    env.checkpoint_saved(tmp_path / "step-00000002", 2)
    assert calls["report"] == [({"step": 2}, None), ({"step": 2}, f"ckpt:{tmp_path / 'step-00000002'}")]


def test_a_run_ray_restarted_resumes_from_rays_checkpoint(ray_worker, tmp_path, monkeypatch):
    import types

    _, calls = ray_worker
    for key, value in RAY.items():
        monkeypatch.setenv(key, value)
    assert parallelx.latest_checkpoint(tmp_path) is None
    kept = tmp_path / "ray" / "checkpoint_0001"
    calls["restored"].append(types.SimpleNamespace(path=str(kept), filesystem=type("LocalFileSystem", (), {})()))
    assert parallelx.latest_checkpoint(tmp_path / "run") == kept, "no checkpoint of its own: Ray's"
    own = tmp_path / "run" / "checkpoints" / "step-00000004"
    own.mkdir(parents=True)
    (own / "state.pt").write_bytes(b"")
    assert parallelx.latest_checkpoint(tmp_path / "run") == own, "the run's own, newest, first"


def test_outside_a_ray_train_function_ray_is_not_detected():
    assert detect_environment({**RAY, "TORCHELASTIC_RUN_ID": "x"}, ["t.py"]).name == "torchrun"


def test_the_ray_launcher_splits_its_options_from_the_scripts():
    from parallelx.launching.ray_train import split_argv

    assert split_argv(["-n", "2", "--gpu", "-m", "recipes.cifar10", "--backend", "ddp", "-n", "x"]) == (
        ["-n", "2", "--gpu"],
        "module",
        "recipes.cifar10",
        ["--backend", "ddp", "-n", "x"],
    )
    assert split_argv(["--storage", "/s", "--env", "A", "train.py", "--lr", "1"]) == (
        ["--storage", "/s", "--env", "A"],
        "file",
        "train.py",
        ["--lr", "1"],
    )
    with pytest.raises(ParallelxError, match="give the script to run"):
        split_argv(["-n", "2"])
