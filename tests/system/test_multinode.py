"""Two machines rehearsed on one: each launcher's own multi-node machinery
(torchrun's c10d rendezvous, horovodrun's host list, deepspeed's hostfile
with ``--no_ssh --node_rank``) starts two "nodes" of one process each on this
machine, over the loopback interface.  The recipe must train exactly what the
same launcher's one-machine 2-process job trains: ``best.pth`` bit for bit.

``OMP_NUM_THREADS=1`` on both sides: on the CPU a process's thread count
decides the summation order inside conv and matmul kernels; torchrun sets one
thread per process only when it starts several on a node, and parallelx
shares the cores only among processes of the same node.  Left alone, a node
of one process takes every core and its weights drift by ~1e-7 (relative)
from the one-machine job's; with equal thread counts they are identical.
``--num-workers 0`` for the same reason: the default is a share of one
machine's cores, and other loader workers draw other random flips.

docs/engines.md ("More than one machine") shows the same commands for a real
cluster.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch
from launching import BIN, ROOT, Result, latest_step, launch, launcher_for, require_launcher, wait_for
from netns import unavailable as no_namespaces

from parallelx.launching.launchers import free_port, resolve_program

pytestmark = [pytest.mark.launcher, pytest.mark.scenario, pytest.mark.timeout(180)]

NODE_TIMEOUT_S = 90
# Two host names that resolve to this machine: horovodrun and deepspeed treat
# them as two nodes, and horovodrun runs both without ssh (a name whose
# address is one of this machine's counts as local).
HOSTS = ("localhost", "127.0.0.1")
RECIPE_ARGS = ["--epochs", "1", "--max-steps", "3", "--batch-size", "16", "--num-workers", "0"]


@pytest.fixture(scope="module")
def cifar_dir(tmp_path_factory) -> Path:
    from recipes.make_data import make_cifar10

    out = tmp_path_factory.mktemp("cifar")
    make_cifar10(out, n_train=128, n_test=32, seed=0)
    return out


def torchrun_nodes(target: list[str], port: int, tmp_path: Path) -> list[list[str]]:
    # c10d rendezvous: both agents meet at one endpoint and number the nodes themselves.
    return [
        [
            resolve_program("torchrun"),
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            f"parallelx-{port}",
            *target,
        ]
        for _ in HOSTS
    ]


def horovodrun_nodes(target: list[str], port: int, tmp_path: Path) -> list[list[str]]:
    # One horovodrun starts every node's processes (over ssh for remote hosts).
    return [
        [
            resolve_program("horovodrun"),
            "-np",
            "2",
            "-H",
            ",".join(f"{h}:1" for h in HOSTS),
            "--gloo",
            "--network-interface",
            "lo",
            sys.executable,
            *target,
        ]
    ]


def deepspeed_nodes(target: list[str], port: int, tmp_path: Path) -> list[list[str]]:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{h} slots=1\n" for h in HOSTS))
    return [
        [
            resolve_program("deepspeed"),
            "--hostfile",
            str(hostfile),
            "--no_ssh",
            "--node_rank",
            str(rank),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            *target,
        ]
        for rank in range(len(HOSTS))
    ]


@dataclass(frozen=True)
class Case:
    backend: str
    target: list[str]
    nodes: Callable[[list[str], int, Path], list[list[str]]]
    #: What each node's launcher log says when it read the layout right ({rank}: the node's).
    node_log: str | None = None


CASES = {
    "torchrun": Case("ddp", ["-m", "recipes.cifar10"], torchrun_nodes),
    "horovodrun": Case("horovod", ["-m", "recipes.cifar10"], horovodrun_nodes),
    # The deepspeed launcher takes a script path, as the README shows.
    "deepspeed": Case(
        "deepspeed", ["recipes/cifar10.py"], deepspeed_nodes, node_log="nnodes=2, num_local_procs=1, node_rank={rank}"
    ),
}


def run_nodes(
    cmds: list[list[str]],
    env: dict[str, str],
    timeout: float,
    *,
    while_running: Callable[[list[subprocess.Popen]], None] | None = None,
    wait_all: bool = False,
) -> list[Result]:
    """Start every command at once, each in its own session, and wait for all.
    A node that fails leaves the others waiting for it in a collective: they
    are killed at once (unless ``wait_all``: a test that stops a node on
    purpose waits for the others to end by themselves); past ``timeout`` every
    process group is killed and the test fails with each node's output.
    ``while_running(procs)`` acts on the running job (its time counts)."""
    logs = [tempfile.TemporaryFile("w+") for _ in cmds]
    procs: list[subprocess.Popen] = []
    start = time.monotonic()
    hung = False
    try:
        for cmd, log in zip(cmds, logs):
            procs.append(
                subprocess.Popen(
                    cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True
                )
            )
        if while_running is not None:
            while_running(procs)
        while any(p.poll() is None for p in procs):
            if not wait_all and any(p.returncode not in (None, 0) for p in procs):
                break
            if time.monotonic() - start > timeout:
                hung = True
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            # torchrun starts its workers in sessions of their own: kill the tree, then the group.
            try:
                for child in psutil.Process(p.pid).children(recursive=True):
                    child.kill()
            except psutil.NoSuchProcess:
                pass
            try:
                os.killpg(p.pid, signal.SIGKILL)  # also a leader's orphaned workers
            except ProcessLookupError:
                pass
            p.wait()
    seconds = time.monotonic() - start
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read().replace("\r", "\n"))
        log.close()
    results = [Result(p.returncode, out, seconds) for p, out in zip(procs, outputs)]
    if hung:
        pytest.fail(f"the nodes ran past {timeout:.0f}s and were killed:\n" + tails(results))
    return results


def tails(results: list[Result]) -> str:
    return "\n".join(f"--- node {i} (exit {r.returncode}):\n{r.tail(40)}" for i, r in enumerate(results))


def node_env() -> dict[str, str]:
    """What ``launching.launch`` gives its jobs, plus the loopback interface."""
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PARALLELX_TIMEOUT": "120",
        "PYTHONFAULTHANDLER": "1",
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }


def load(path: Path) -> dict[str, torch.Tensor]:
    assert path.is_file(), f"{path} was not written"
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def one_machine(cifar_dir, tmp_path_factory) -> Path:
    """best.pth of the one-machine 2-process torchrun job: with one thread per
    process the three launchers train it bit for bit alike, so it is every
    two-node run's reference."""
    require_launcher("torchrun")
    out = tmp_path_factory.mktemp("one") / "out"
    ref = launch(
        "torchrun",
        [
            "-m",
            "recipes.cifar10",
            "--backend",
            "ddp",
            "--data-dir",
            str(cifar_dir),
            "--out-dir",
            str(out),
            *RECIPE_ARGS,
        ],
        nproc=2,
        timeout=NODE_TIMEOUT_S,
        env={"OMP_NUM_THREADS": "1"},
    )
    assert ref.returncode == 0, f"one-machine torchrun exited {ref.returncode}:\n{ref.tail()}"
    return out / "best.pth"


@pytest.fixture(scope="module")
def without_namespaces() -> None:
    """Where network namespaces can be made, tests/system/test_netns.py runs each launcher's two nodes on two
    real addresses against the same one-machine weights: this loopback rehearsal is for the machines that cannot."""
    if no_namespaces() is None:
        pytest.skip("tests/system/test_netns.py runs each launcher on two real addresses here")


@pytest.mark.parametrize("launcher", list(CASES))
def test_two_nodes_train_what_one_machine_trains(launcher, without_namespaces, cifar_dir, one_machine, tmp_path):
    require_launcher(launcher)
    case = CASES[launcher]

    def args(out: Path) -> list[str]:
        return [
            *case.target,
            "--backend",
            case.backend,
            "--data-dir",
            str(cifar_dir),
            "--out-dir",
            str(out),
            *RECIPE_ARGS,
        ]

    port = free_port()
    try:
        results = run_nodes(case.nodes(args(tmp_path / "two"), port, tmp_path), node_env(), NODE_TIMEOUT_S)
    finally:
        cleanup = launcher_for(launcher).cleanup
        if cleanup is not None:
            cleanup(port)
    assert all(r.returncode == 0 for r in results), f"two-node {launcher} failed:\n{tails(results)}"
    output = "\n".join(r.output for r in results)
    assert output.count("Best val Acc: ") == 1, f"expected one main rank across the nodes:\n{tails(results)}"
    if case.node_log is not None:
        for rank, r in enumerate(results):
            assert case.node_log.format(rank=rank) in r.output, f"node {rank}:\n{r.tail()}"

    metrics = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["backend"] == case.backend
    one, two = load(one_machine), load(tmp_path / "two" / "best.pth")
    assert one.keys() == two.keys()
    differ = {k: (one[k] - two[k]).abs().max().item() for k in one if not torch.equal(one[k], two[k])}
    assert not differ, f"two-node {launcher} trained different weights than one machine (max abs diff): {differ}"
    print(f"{launcher}: two nodes {results[0].seconds:.1f}s, weights bit-identical to one machine's")


SURVIVAL_ARGS = ["--epochs", "2", "--batch-size", "16", "--num-workers", "0", "--lr", "0.05", "--checkpoint-every", "2"]


@pytest.fixture(scope="module")
def uninterrupted(cifar_dir, tmp_path_factory) -> Path:
    """last.pth of the uninterrupted one-machine ddp run of the survival tests."""
    require_launcher("torchrun")
    out = tmp_path_factory.mktemp("uninterrupted") / "out"
    ref = launch(
        "torchrun",
        [
            "-m",
            "recipes.cifar10",
            "--backend",
            "ddp",
            "--data-dir",
            str(cifar_dir),
            "--out-dir",
            str(out),
            *SURVIVAL_ARGS,
        ],
        nproc=2,
        timeout=NODE_TIMEOUT_S,
        env={"OMP_NUM_THREADS": "1"},
    )
    assert ref.returncode == 0, ref.tail()
    return out / "last.pth"


@pytest.mark.timeout(420)
def test_two_nodes_survive_a_kill_and_a_preemption_and_resume(cifar_dir, uninterrupted, tmp_path):
    """torchrun on two "nodes" (c10d rendezvous, ``--max-restarts 2``,
    ``--resume auto``), one job through three events:

    1. node 1's rank is SIGKILLed from outside after the first checkpoint:
       both agents restart their workers (node 1's counts a restart, node 0's
       may see only a change of membership, so their restart counts differ),
       which resume from the latest checkpoint;
    2. later the scheduler's SIGTERM reaches both agents, which forward it
       to their workers: both ranks save at the same step boundary and stop;
    3. a new two-node launch resumes from that checkpoint and ends with
       ``last.pth`` bit-identical to an uninterrupted one-machine ddp run.

    The deepspeed backend's resume after a killed rank under torchrun is
    tests/system/test_resume.py's; the same on one machine or two."""
    args = ["--data-dir", str(cifar_dir), *SURVIVAL_ARGS, "--backend", "ddp"]

    out, pids = tmp_path / "two", tmp_path / "pids"
    target = ["tests/support/resume_wrapper.py", *args, "--out-dir", str(out), "--resume", "auto"]

    def nodes() -> list[list[str]]:
        return [[*cmd[:1], "--max-restarts", "2", *cmd[1:]] for cmd in torchrun_nodes(target, free_port(), tmp_path)]

    events: dict[str, int] = {}

    def kill_then_preempt(procs: list[subprocess.Popen]) -> None:
        wait_for(lambda: latest_step(out) >= 2 and (pids / "rank1-attempt0.pid").exists(), procs, "a first checkpoint")
        os.kill(int((pids / "rank1-attempt0.pid").read_text()), signal.SIGKILL)
        events["killed_after"] = latest_step(out)
        wait_for(lambda: latest_step(out) >= 4, procs, "a checkpoint after the restart")
        for p in procs:
            os.kill(p.pid, signal.SIGTERM)  # each agent forwards it to its worker

    env = {**node_env(), "PXT_DELAY": "0.4", "PXT_PIDS": str(pids)}
    first = run_nodes(nodes(), env, NODE_TIMEOUT_S * 2, while_running=kill_then_preempt, wait_all=True)
    output = "\n".join(r.output for r in first)
    assert "resuming from " in output, f"the workers did not resume after the kill:\n{tails(first)}"
    assert "preempted (SIGTERM)" in output, f"no preemption checkpoint:\n{tails(first)}"
    assert not (out / "last.pth").exists(), "the preempted job must not have finished"
    saved = latest_step(out)
    # Step 4 when the SIGTERM arrived between epoch 1's end checkpoint and
    # epoch 2's first step (nothing new to save then), else a step of epoch 2.
    assert 4 <= saved < 8, f"the preemption should stop the job after the restart's checkpoint, got step {saved}"

    second = run_nodes(nodes(), node_env(), NODE_TIMEOUT_S)
    assert all(r.returncode == 0 for r in second), f"the resumed two-node job failed:\n{tails(second)}"
    assert f"step-{saved:08d}" in "\n".join(r.output for r in second), tails(second)
    one, two = load(uninterrupted), load(out / "last.pth")
    assert one.keys() == two.keys()
    differ = [k for k in one if not torch.equal(one[k], two[k])]
    assert not differ, f"the two-node run, killed, preempted and resumed, ended with other weights in {differ}"
    outcome = "bit-identical"
    print(
        f"two nodes, ddp: killed after checkpoint step {events['killed_after']}, preempted at step {saved}, "
        f"resumed: last.pth {outcome} ({first[0].seconds:.0f}s + {second[0].seconds:.0f}s)"
    )
