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

The README's "More than one machine" shows the same commands for a real
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
from launching import BIN, ROOT, Result, launch, launcher_for, require_launcher

from parallelx.launch import free_port, resolve_program

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(180)]

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
    return [[resolve_program("torchrun"), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"parallelx-{port}", *target]
            for _ in HOSTS]


def horovodrun_nodes(target: list[str], port: int, tmp_path: Path) -> list[list[str]]:
    # One horovodrun starts every node's processes (over ssh for remote hosts).
    return [[resolve_program("horovodrun"), "-np", "2", "-H", ",".join(f"{h}:1" for h in HOSTS), "--gloo",
             "--network-interface", "lo", sys.executable, *target]]


def deepspeed_nodes(target: list[str], port: int, tmp_path: Path) -> list[list[str]]:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{h} slots=1\n" for h in HOSTS))
    return [[resolve_program("deepspeed"), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(rank),
             "--master_addr", "127.0.0.1", "--master_port", str(port), *target]
            for rank in range(len(HOSTS))]


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
    "deepspeed": Case("deepspeed", ["recipes/cifar10.py"], deepspeed_nodes,
                      node_log="nnodes=2, num_local_procs=1, node_rank={rank}"),
}


def run_nodes(cmds: list[list[str]], env: dict[str, str], timeout: float) -> list[Result]:
    """Start every command at once, each in its own session, and wait for all.
    A node that fails leaves the others waiting for it in a collective: they
    are killed at once; past ``timeout`` every process group is killed and the
    test fails with each node's output."""
    logs = [tempfile.TemporaryFile("w+") for _ in cmds]
    procs: list[subprocess.Popen] = []
    start = time.monotonic()
    hung = False
    try:
        for cmd, log in zip(cmds, logs):
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True))
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):
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
        outputs.append(log.read())
        log.close()
    results = [Result(p.returncode, out, seconds) for p, out in zip(procs, outputs)]
    if hung:
        pytest.fail(f"the nodes ran past {timeout:.0f}s and were killed:\n" + tails(results))
    return results


def tails(results: list[Result]) -> str:
    return "\n".join(f"--- node {i} (exit {r.returncode}):\n{r.tail(30)}" for i, r in enumerate(results))


def node_env() -> dict[str, str]:
    """What ``launching.launch`` gives its jobs, plus the loopback interface."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PARALLELX_TIMEOUT": "120", "PYTHONFAULTHANDLER": "1",
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1"}


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
    ref = launch("torchrun", ["-m", "recipes.cifar10", "--backend", "ddp", "--data-dir", str(cifar_dir),
                              "--out-dir", str(out), *RECIPE_ARGS], nproc=2, timeout=NODE_TIMEOUT_S,
                 env={"OMP_NUM_THREADS": "1"})
    assert ref.returncode == 0, f"one-machine torchrun exited {ref.returncode}:\n{ref.tail()}"
    return out / "best.pth"


@pytest.mark.parametrize("launcher", list(CASES))
def test_two_nodes_train_what_one_machine_trains(launcher, cifar_dir, one_machine, tmp_path):
    require_launcher(launcher)
    case = CASES[launcher]

    def args(out: Path) -> list[str]:
        return [*case.target, "--backend", case.backend, "--data-dir", str(cifar_dir), "--out-dir", str(out),
                *RECIPE_ARGS]

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

