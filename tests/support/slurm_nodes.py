"""A real Slurm across the nodes of a :class:`netns.Cluster`: slurmctld on
node 0, one slurmd per node (``NodeAddr`` the node's cluster address), each
daemon in its node's namespace; munged, whose socket is a file, serves them
all from the host (a cluster's munged runs on every node with one shared key;
here one daemon and one key do).

Everything lives under a temporary directory (keys, state, spool, logs),
``SLURM_CONF`` points the client commands at its configuration, and the
client commands run on node 0, the cluster's login node::

    with NodesSlurm(cluster, tmp) as slurm:
        slurm.run(["srun", "-N", "2", "hostname"])   # n0, n1

The one-machine Slurm of the other tests is tests/support/slurm_cluster.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from netns import Cluster
from slurm_cluster import SlurmDaemons, unavailable  # noqa: F401  (the same programs, the same reasons to skip)

CPUS = 2
SLURMCTLD_PORT, SLURMD_PORT = 6817, 6818  # in the nodes' own namespaces: no clash with the host's

CONF = """\
ClusterName=pxnodes
SlurmctldHost={head}({head_addr})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
KillWait=10
MessageTimeout=20
{nodes}
PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""


class NodesSlurm(SlurmDaemons):
    """munged on the host, slurmctld on node 0, a slurmd on every node."""

    what = "the nodes' Slurm"

    def __init__(self, cluster: Cluster, root: Path) -> None:
        super().__init__(root)
        self.cluster = cluster

    @property
    def head(self):  # type: ignore[no-untyped-def]
        return self.cluster.nodes[0]

    def run(self, cmd: list[str], timeout: float = 30, **kwargs) -> subprocess.CompletedProcess:  # type: ignore[no-untyped-def]
        """A client command on the login node (node 0)."""
        kwargs.setdefault("env", self.env())
        return self.head.run(cmd, timeout=timeout, **kwargs)

    def client(self, cmd: list[str], env: dict[str, str], check: bool = False) -> subprocess.CompletedProcess:
        return self.run(cmd, env=env, check=check)

    def _start(self, timeout: float) -> None:
        nodes = self.cluster.nodes
        for node in nodes:
            (self.root / f"spool-{node.hostname}").mkdir(exist_ok=True)
        self.conf.write_text(
            CONF.format(
                root=self.root,
                head=self.head.hostname,
                head_addr=self.head.address,
                ctld_port=SLURMCTLD_PORT,
                slurmd_port=SLURMD_PORT,
                munge_socket=self.munge_socket,
                nodes="\n".join(
                    f"NodeName={n.hostname} NodeAddr={n.address} NodeHostname={n.hostname} CPUs={CPUS} State=UNKNOWN"
                    for n in nodes
                ),
                names=",".join(n.hostname for n in nodes),
            )
        )
        env = self.env()
        self._spawn(self.head.argv(["slurmctld", "-D", "-i", "-f", str(self.conf)]), "slurmctld", env)
        for node in nodes:
            self._spawn(
                node.argv(["slurmd", "-D", "-N", node.hostname, "-f", str(self.conf)]), f"slurmd-{node.hostname}", env
            )

    def _idle(self) -> bool:
        self._check_alive()
        out = self.run(["sinfo", "-h", "-N", "-o", "%t"], timeout=20)
        states = out.stdout.split()
        return out.returncode == 0 and len(states) == len(self.cluster.nodes) and all(s == "idle" for s in states)
