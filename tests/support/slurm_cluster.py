"""A real one-machine Slurm for the tests: munged, slurmctld and slurmd from
the distribution's packages (Debian's ``munge`` and ``slurm-wlm``), configured
under a temporary directory and started as root, stopped afterwards.

Nothing outside that directory is touched: its own munge key and socket, its
own state and spool directories, ports chosen free, and ``SLURM_CONF``
pointing the client commands (``srun``, ``sbatch``, ``scancel``) at its
configuration.  One node, ``localhost``, with 2 CPUs, in one partition::

    with SlurmCluster(tmp) as slurm:
        subprocess.run(["srun", "-n", "2", "hostname"], env=slurm.env())

:func:`unavailable` says why such a cluster cannot run here (not root, a
program missing), for a skip that names the reason.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from parallelx.launching.launchers import free_port

PROGRAMS = ("munged", "mungekey", "slurmctld", "slurmd", "srun", "sbatch", "sinfo", "scancel", "scontrol")
CPUS = 2

CONF = """\
ClusterName=parallelx
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
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
KillWait=30
MessageTimeout=30
NodeName=localhost NodeHostname=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def unavailable() -> str | None:
    """Why a one-machine Slurm cannot be started here, or None."""
    if os.geteuid() != 0:
        return "the test Slurm runs its daemons as root (slurmd starts jobs as their user); not root here"
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if missing:
        return (
            f"{', '.join(missing)} not installed (apt-get install slurm-wlm munge, which scripts/setup.sh does as root)"
        )
    return None


class SlurmDaemons:
    """What every test Slurm shares: munged with its own key and socket under
    ``root``, daemons started in their own sessions with their output in
    ``root/<name>.out``, the client commands' environment, ``sbatch`` and
    waiting for its job, the logs for a failure's message, the stop.  The
    subclasses start slurmctld and the slurmds, and say how a client command
    runs (:meth:`client`) and when the nodes are ready (:meth:`_idle`)."""

    what = "the test Slurm"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self._procs: list[subprocess.Popen] = []

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        # Nothing of an enclosing job's own Slurm or torch.distributed variables.
        for key in [k for k in env if k.startswith(("SLURM_", "SRUN_", "SBATCH_", "SALLOC_"))]:
            del env[key]
        env["SLURM_CONF"] = str(self.conf)
        return env

    def client(self, cmd: list[str], env: dict[str, str], check: bool = False) -> subprocess.CompletedProcess:
        """A client command (``sbatch``, ``scontrol``, ``sinfo``) with ``env``; its output captured as text."""
        raise NotImplementedError

    def batch(self, args: list[str], env: dict[str, str], timeout: float) -> tuple[str, int]:
        """``sbatch args`` and wait for the job: (final state, exit status).  Polls
        ``scontrol`` every 0.2 s: ``sbatch --wait`` polls at growing intervals
        and returned 24 s after a 16 s job here."""
        job = self.client(["sbatch", "--parsable", *args], env, check=True).stdout.strip().split(";")[0]
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            info = self.client(["scontrol", "show", "job", "-o", job], env).stdout
            fields = dict(f.split("=", 1) for f in info.split() if "=" in f)
            if fields.get("JobState") not in (None, "PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                return fields["JobState"], int(fields.get("ExitCode", "0:0").split(":")[0])
            time.sleep(0.2)
        self.client(["scancel", job], env)
        raise TimeoutError(f"batch job {job} still running after {timeout:.0f}s")

    def start(self, timeout: float = 60) -> SlurmDaemons:
        try:
            self._start_munge(timeout)
            self._start(timeout)
            self._wait(self._idle, timeout, "node idle in sinfo")
        except BaseException:
            self.stop()
            raise
        return self

    def _start_munge(self, timeout: float) -> None:
        munge = self.root / "munge"
        munge.mkdir(parents=True, exist_ok=True)
        (self.root / "state").mkdir(exist_ok=True)
        munge.chmod(0o755)  # munged wants its socket's directory searchable by all
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

    def _start(self, timeout: float) -> None:
        """Write ``slurm.conf``, start slurmctld and the slurmds."""
        raise NotImplementedError

    def _idle(self) -> bool:
        raise NotImplementedError

    def _spawn(self, cmd: list[str], name: str, env: dict[str, str] | None = None) -> None:
        log = open(self.root / f"{name}.out", "w")
        self._procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
        log.close()

    def _check_alive(self) -> None:
        for proc in self._procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args} exited with status {proc.returncode}:\n{self.logs()}")

    def _wait(self, ready, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
        end = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > end:
                raise RuntimeError(f"{self.what}: no {what} after {timeout:.0f}s:\n{self.logs()}")
            time.sleep(0.2)

    def logs(self, n: int = 15) -> str:
        parts = []
        for path in sorted(self.root.rglob("*.log")) + sorted(self.root.glob("*.out")):
            lines = path.read_text(errors="replace").splitlines()[-n:]
            parts.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    def stop(self) -> None:
        """SIGTERM every daemon (the slurmds first, munged last), SIGKILL what is left after 10 s."""
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        self._procs.clear()

    def __enter__(self) -> SlurmDaemons:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SlurmCluster(SlurmDaemons):
    """One node, ``localhost``: slurmctld and slurmd on this machine; :meth:`env` is what the client commands need."""

    def client(self, cmd: list[str], env: dict[str, str], check: bool = False) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, check=check, cwd=env.get("PWD"))

    def _start(self, timeout: float) -> None:
        (self.root / "spool").mkdir(exist_ok=True)
        self.conf.write_text(
            CONF.format(
                root=self.root,
                ctld_port=free_port(),
                slurmd_port=free_port(),
                munge_socket=self.munge_socket,
                cpus=CPUS,
            )
        )
        env = self.env()
        self._spawn(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld", env)
        self._spawn(["slurmd", "-D", "-N", "localhost", "-f", str(self.conf)], "slurmd", env)

    def _idle(self) -> bool:
        self._check_alive()
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=self.env(), capture_output=True, text=True)
        return out.returncode == 0 and out.stdout.strip() in ("idle", "mix", "alloc")
