"""Slurm: ``srun`` with one task per rank, no other launcher::

    srun --ntasks-per-node 2 python -m recipes.cifar10 --backend ddp ...

Each task of a job step is one rank: ``SLURM_PROCID`` of
``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID`` of the tasks on its node
(``SLURM_STEP_TASKS_PER_NODE``, compressed as ``2(x3),1``).  The rendezvous is
the first host of the step's node list (compressed as ``node[01-04,07]``) on a
port derived from the job and step ids, unless ``MASTER_ADDR`` /
``MASTER_PORT`` say otherwise.

Not Slurm, so a world of one as without any launcher: a process started by
hand in an allocation (``salloc``, then ``python train.py``) or by the batch
script itself, which belong to no job step, and a step of one task.  A
launcher started inside the job (torchrun, the deepspeed launcher,
horovodrun, one task per node) is detected before Slurm: its own variables
describe the world.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from parallelx.errors import LaunchError
from parallelx.launching.environments.environment import ClusterEnvironment, World, int_var

#: Derived rendezvous ports: below Linux's ephemeral range (32768-60999), so
#: that no outgoing connection holds one; a job's concurrent steps get
#: different ports.
PORT_BASE, PORT_SPAN = 20000, 10000
_STEPS_PER_JOB = 16


def expand_hostlist(text: str) -> list[str]:
    """The host names of a Slurm host list, in order: ``node[01-03,07],gpu2``
    -> ``node01 node02 node03 node07 gpu2``; ranges keep the width of their
    first number (``[08-10]`` -> ``08 09 10``); several bracket groups in one
    name expand as a product (``r[1-2]n[1-2]`` -> ``r1n1 r1n2 r2n1 r2n2``)."""
    hosts: list[str] = []
    for item in _split_outside_brackets(text.strip(), text):
        hosts += _expand_item(item, text)
    return hosts


def _split_outside_brackets(text: str, whole: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise LaunchError(f"Slurm host list {whole!r}: nested brackets")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise LaunchError(f"Slurm host list {whole!r}: ']' without '['")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise LaunchError(f"Slurm host list {whole!r}: '[' without ']'")
    items.append(text[start:])
    if any(not item for item in items):
        raise LaunchError(f"Slurm host list {whole!r}: an empty host name")
    return items


def _expand_item(item: str, whole: str) -> list[str]:
    m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
    if m is None:
        return [item]
    prefix, body, rest = m.groups()
    tails = _expand_item(rest, whole) if rest else [""]
    names = []
    for part in body.split(","):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise LaunchError(f"Slurm host list {whole!r}: {part!r} is not a number or a range of numbers")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise LaunchError(f"Slurm host list {whole!r}: range {part!r} runs backwards")
        names += [f"{prefix}{n:0{len(low)}d}{tail}" for n in range(first, last + 1) for tail in tails]
    return names


def expand_tasks_per_node(text: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` as one count per node: ``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in text.strip().split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            raise LaunchError(f"Slurm tasks per node {text!r}: {part!r} is not N or N(xK)")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def derived_port(job_id: int, step_id: int) -> int:
    """The rendezvous port of a job step: the same in every task, another for another job or step."""
    return PORT_BASE + (job_id * _STEPS_PER_JOB + step_id % _STEPS_PER_JOB) % PORT_SPAN


def _step_id(environ: Mapping[str, str]) -> str | None:
    return environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID")


class Slurm(ClusterEnvironment):
    name = "slurm"
    default_backend = "ddp"
    # Below every launcher (a launcher started inside a job describes the world), above plain variables.
    priority = 20

    @classmethod
    def detect(cls, environ: Mapping[str, str], argv: Sequence[str]) -> bool:
        # A task of a job step with company; the batch script and a shell under salloc have no step id.
        if "SLURM_PROCID" not in environ or _step_id(environ) is None:
            return False
        try:
            return int_var(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") > 1
        except LaunchError:
            return True  # a malformed variable: world() says which

    def world(self) -> World:
        e = self.environ
        size = int_var(e, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        return World(
            rank=int_var(e, "SLURM_PROCID"),
            world_size=size,
            local_rank=int_var(e, "SLURM_LOCALID", default=0),
            local_world_size=self._local_size(size),
            master_addr=e.get("MASTER_ADDR") or self.hosts()[0],
            master_port=int_var(e, "MASTER_PORT", default=0) or self._port(),
        )

    def hosts(self) -> list[str]:
        """The step's hosts (the job's, where the step's are not given)."""
        for key in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
            if self.environ.get(key):
                return expand_hostlist(self.environ[key])
        raise LaunchError(
            "Slurm: none of $SLURM_STEP_NODELIST, $SLURM_JOB_NODELIST, $SLURM_NODELIST is set; "
            "set MASTER_ADDR to the host of rank 0"
        )

    def _local_size(self, size: int) -> int:
        e = self.environ
        for key in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
            if e.get(key):
                counts = expand_tasks_per_node(e[key])
                node = int_var(e, "SLURM_NODEID", default=0)
                if node >= len(counts):
                    raise LaunchError(f"Slurm: $SLURM_NODEID={node} but ${key}={e[key]} names {len(counts)} node(s)")
                return counts[node]
        return int_var(e, "SLURM_NTASKS_PER_NODE", default=size)

    def _port(self) -> int:
        step = _step_id(self.environ) or "0"
        return derived_port(int_var(self.environ, "SLURM_JOB_ID", "SLURM_JOBID"), int(step) if step.isdigit() else 0)

    def why(self) -> str:
        e = self.environ
        return (
            f"SLURM_PROCID={e.get('SLURM_PROCID')} of "
            f"{e.get('SLURM_STEP_NUM_TASKS') or e.get('SLURM_NTASKS')} tasks, job "
            f"{e.get('SLURM_JOB_ID') or e.get('SLURM_JOBID')} step {_step_id(e)}"
        )

    def check_devices(self, gpus: int) -> None:
        w = self.world()
        if 0 < gpus < w.local_world_size:
            raise LaunchError(
                f"slurm: this job step runs {w.local_world_size} tasks on this node but each task sees {gpus} "
                f"GPU(s); ask for at most one task per GPU and give every task the node's GPUs "
                f"(srun --ntasks-per-node {gpus} --gpus-per-node {gpus}), or run on the CPU with --device cpu"
            )

    def hint(self) -> str:
        e = self.environ
        nodes = expand_hostlist(e.get("SLURM_JOB_NODELIST") or ",".join(self.hosts()))
        counts = expand_tasks_per_node(e.get("SLURM_TASKS_PER_NODE") or str(self.world().local_world_size))
        slots = ",".join(f"{h}:{n}" for h, n in zip(nodes, counts + counts[-1:] * len(nodes)))
        return (
            f"; under Slurm start that launcher once per job, not in every task (from the batch script, or "
            f"srun --ntasks 1), with the allocation's hosts and slots {slots}"
        )
