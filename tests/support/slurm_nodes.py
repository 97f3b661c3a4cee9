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

import os
import signal
import subprocess
import time
from pathlib import Path

from netns import Cluster
from slurm_cluster import unavailable  # noqa: F401  (the same programs, the same reasons to skip)

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


class NodesSlurm:
    """munged on the host, slurmctld on node 0, a slurmd on every node."""

    def __init__(self, cluster: Cluster, root: Path) -> None:
        self.cluster = cluster
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self._procs: list[subprocess.Popen] = []

    @property
    def head(self):  # type: ignore[no-untyped-def]
        return self.cluster.nodes[0]

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        for key in [k for k in env if k.startswith(("SLURM_", "SRUN_", "SBATCH_", "SALLOC_"))]:
            del env[key]
        env["SLURM_CONF"] = str(self.conf)
        return env

    def run(self, cmd: list[str], timeout: float = 30, **kwargs) -> subprocess.CompletedProcess:  # type: ignore[no-untyped-def]
        """A client command on the login node (node 0)."""
        kwargs.setdefault("env", self.env())
        return self.head.run(cmd, timeout=timeout, **kwargs)

    def start(self, timeout: float = 60) -> NodesSlurm:
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout: float) -> None:
        munge = self.root / "munge"
        for sub in ("munge", "state", *(f"spool-{n.hostname}" for n in self.cluster.nodes)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        munge.chmod(0o755)
        key = munge / "munge.key"
        subprocess.run(["mungekey", "--create", "--keyfile", str(key), "--force"], check=True, capture_output=True)
        key.chmod(0o400)
        self._spawn(
            [
                "munged",
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={self.munge_socket}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--log-file={munge / 'munged.log'}",
                f"--seed-file={munge / 'munged.seed'}",
            ],
            "munged",
        )
        self._wait(lambda: self.munge_socket.exists(), timeout, "munged's socket")
        nodes = self.cluster.nodes
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
        self._wait(self._idle, timeout, "every node idle in sinfo")

    def _spawn(self, cmd: list[str], name: str, env: dict[str, str] | None = None) -> None:
        log = open(self.root / f"{name}.out", "w")
        self._procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
        log.close()

    def _idle(self) -> bool:
        for proc in self._procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args} exited with status {proc.returncode}:\n{self.logs()}")
        out = self.run(["sinfo", "-h", "-N", "-o", "%t"], timeout=20)
        states = out.stdout.split()
        return out.returncode == 0 and len(states) == len(self.cluster.nodes) and all(s == "idle" for s in states)

    def _wait(self, ready, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
        end = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > end:
                raise RuntimeError(f"the nodes' Slurm: no {what} after {timeout:.0f}s:\n{self.logs()}")
            time.sleep(0.2)

    def batch(self, args: list[str], env: dict[str, str], timeout: float) -> tuple[str, int]:
        """``sbatch args`` on the login node, then wait for the job: (final state, exit status)."""
        job = self.run(["sbatch", "--parsable", *args], env=env, check=True).stdout.strip().split(";")[0]
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            info = self.run(["scontrol", "show", "job", "-o", job], env=env).stdout
            fields = dict(f.split("=", 1) for f in info.split() if "=" in f)
            if fields.get("JobState") not in (None, "PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                return fields["JobState"], int(fields.get("ExitCode", "0:0").split(":")[0])
            time.sleep(0.2)
        self.run(["scancel", job], env=env)
        raise TimeoutError(f"batch job {job} still running after {timeout:.0f}s")

    def logs(self, n: int = 15) -> str:
        parts = []
        for path in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.out")):
            lines = path.read_text(errors="replace").splitlines()[-n:]
            parts.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    def stop(self) -> None:
        """SIGTERM every daemon (slurmds first, munged last), SIGKILL what is left after 10 s."""
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        self._procs.clear()

    def __enter__(self) -> NodesSlurm:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
