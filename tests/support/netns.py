"""Several machines on one: network namespaces as nodes, for the system tests.

A :class:`Cluster` of N nodes is N network namespaces on a private bridge,
each node with what a cluster machine has::

    eth0  a first interface that reaches nothing the job needs: the node's
          "public" network (its default route goes there), on a link of its
          own that no other node shares
    eth1  the cluster network: an address on the bridge (10.x.y.10 + rank),
          the only way to the other nodes
    lo    its own loopback

and a host name (``n0``, ``n1``, ...) in a UTS namespace of its own, with an
``/etc/hosts`` (``/etc/netns/<namespace>/hosts``, which ``ip netns exec``
mounts over ``/etc/hosts``) that maps every node's name to its cluster
address, except its own name, which maps to ``127.0.1.1`` as on a Debian
machine, and a ``resolv.conf`` with no name server outside the node.  A program that trusts the host name, or takes the first interface,
picks an address that the other nodes cannot reach.  The file system is
shared, as on a cluster with a shared file system.

Nothing leaves the test's own namespaces and bridge: the bridge has no
address in the host's namespace, the subnets are private ones the host does
not use (checked), and the decoy links end in the host's namespace with no
address.  Names start with ``pxn<pid>x<seq>`` (pid: the creating process), so
that parallel tests never collide and :func:`sweep` can remove what a killed
run left behind::

    with Cluster(2) as cluster:
        n0, n1 = cluster.nodes
        subprocess.run(n1.argv(["ping", "-c1", n0.address]))
        cluster.set_link(n1, up=False)        # node 1 drops off the network

:func:`unavailable` says why namespaces cannot be made here (not root, no
``ip``), for a skip that names the reason.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

PREFIX = "pxn"
ETC_NETNS = Path("/etc/netns")
#: The private /24s tried, in order: the cluster network and the decoy network of one cluster.
CANDIDATES = [ipaddress.ip_network(f"10.231.{i}.0/24") for i in range(7, 250, 2)]
#: Host part of node 0's address (node r: FIRST_HOST + r).
FIRST_HOST = 10
#: The decoy interface and the cluster interface inside every node.
DECOY_IF, CLUSTER_IF = "eth0", "eth1"
#: Run by ``Node.argv`` in the node's network namespace: a mount and UTS namespace of
#: its own (private: nothing propagates to the host), the node's /etc files, its name.
_ON_NODE = [
    "unshare",
    "--mount",
    "--uts",
    "--propagation",
    "private",
    "--",
    "sh",
    "-c",
    'for f in /etc/netns/"$1"/*; do mount --bind "$f" /etc/"${f##*/}" || exit 1; done; '
    'hostname "$0" && shift && exec "$@"',
]
_NAME = re.compile(rf"^{PREFIX}([0-9a-f]+)x([0-9a-f]+)")
_seq = itertools.count()


def unavailable() -> str | None:
    """Why nodes cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); not root here"
    missing = [p for p in ("ip", "unshare", "nsenter") if shutil.which(p) is None]
    if missing:
        return f"{', '.join(missing)} not found (Debian: apt-get install iproute2 util-linux)"
    probe = f"{PREFIX}{os.getpid():x}xprobe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ours(name: str, *, only_dead: bool) -> bool:
    m = _NAME.match(name)
    return m is not None and not (only_dead and _alive(int(m.group(1), 16)))


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line.strip()]


def _links() -> list[str]:
    names = []
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) > 1:
            names.append(parts[1].strip().split("@")[0])
    return names


def _kill_inside(ns: str) -> None:
    """SIGKILL every process whose network namespace is ``ns`` (all started by the test)."""
    for _ in range(20):
        pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _remove(namespaces: list[str], links: list[str]) -> None:
    for ns in namespaces:
        _kill_inside(ns)
        _ip("netns", "del", ns, check=False)
        shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
    for link in links:
        _ip("link", "del", link, check=False)


def sweep() -> list[str]:
    """Remove the namespaces, links and ``/etc/netns`` folders of ours whose
    creating process is gone (a run that was killed); returns their names."""
    namespaces = [n for n in _namespaces() if _ours(n, only_dead=True)]
    links = [n for n in _links() if _ours(n, only_dead=True)]
    folders = [p.name for p in ETC_NETNS.glob(f"{PREFIX}*") if _ours(p.name, only_dead=True)]
    _remove(namespaces, links)
    for name in folders:
        shutil.rmtree(ETC_NETNS / name, ignore_errors=True)
    return sorted({*namespaces, *links, *folders})


def used_networks() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks this machine's own namespace has addresses or routes in."""
    nets = []
    for line in _ip("-4", "-o", "addr", "show", check=False).stdout.splitlines():
        m = re.search(r"inet (\S+)", line)
        if m:
            nets.append(ipaddress.ip_interface(m.group(1)).network)
    for line in _ip("-4", "route", "show", "table", "all", check=False).stdout.splitlines():
        first = line.split()[0] if line.split() else ""
        if first in ("local", "broadcast", "unreachable", "prohibit", "blackhole"):
            first = line.split()[1]
        if first == "default":
            continue
        try:
            nets.append(ipaddress.ip_network(first, strict=False))
        except ValueError:
            pass
    return nets


def free_subnets(n: int) -> list[ipaddress.IPv4Network]:
    """``n`` of :data:`CANDIDATES` that overlap nothing this machine uses."""
    used = used_networks()
    free = [c for c in CANDIDATES if not any(c.overlaps(u) for u in used)]
    if len(free) < n:
        raise RuntimeError(f"no {n} free private /24s among {CANDIDATES[0]}...: this machine uses {used}")
    return free[:n]


@dataclass(frozen=True)
class Node:
    """One machine: its namespace, host name and addresses."""

    rank: int
    ns: str
    hostname: str
    address: str  # on CLUSTER_IF, reaches the other nodes
    decoy_address: str  # on DECOY_IF, reaches no other node
    switch_port: str  # the bridge's end of the cluster link (down: the node is off the network)

    def argv(self, cmd: list[str]) -> list[str]:
        """``cmd`` run on this node: in its network namespace, with its own
        host name and its ``/etc`` files (``/etc/netns/<namespace>/*``
        mounted over ``/etc``, as ``ip netns exec`` does; ``ip netns exec``
        itself also mounts a new ``/sys``, which hides the cgroup file systems
        slurmd needs)."""
        return ["nsenter", f"--net=/run/netns/{self.ns}", "--", *_ON_NODE, self.hostname, self.ns, *cmd]

    def run(self, cmd: list[str], timeout: float = 30, **kwargs) -> subprocess.CompletedProcess:  # type: ignore[no-untyped-def]
        return subprocess.run(self.argv(cmd), capture_output=True, text=True, timeout=timeout, **kwargs)


class Cluster:
    """``n`` nodes on a private bridge; removed on :meth:`close` (and by
    :func:`sweep` if the process that made them was killed)."""

    def __init__(self, n: int = 2, *, own_name_loopback: bool = True) -> None:
        #: Each node's own name maps to 127.0.1.1 (Debian's default), not to its address.
        self.own_name_loopback = own_name_loopback
        self.tag = f"{PREFIX}{os.getpid():x}x{next(_seq):x}"
        self.bridge = f"{self.tag}b"
        net, decoy = free_subnets(2)
        self.network, self.decoy_network = net, decoy
        hosts = list(net.hosts())
        dhosts = list(decoy.hosts())
        self.nodes = [
            Node(
                rank=r,
                ns=f"{self.tag}-n{r}",
                hostname=f"n{r}",
                address=str(hosts[FIRST_HOST - 1 + r]),
                decoy_address=str(dhosts[FIRST_HOST - 1 + r]),
                switch_port=f"{self.tag}a{r}",
            )
            for r in range(n)
        ]
        self._namespaces: list[str] = []
        self._links: list[str] = []
        self._daemons: list[subprocess.Popen] = []

    def hosts_file(self, node: Node) -> str:
        lines = ["127.0.0.1 localhost"]
        if self.own_name_loopback:
            lines.append(f"127.0.1.1 {node.hostname}")
        lines += [f"{other.address} {other.hostname}" for other in self.nodes]
        return "\n".join(lines) + "\n"

    def start(self) -> Cluster:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge", "forward_delay", "0")
        self._links.append(self.bridge)
        _ip("link", "set", self.bridge, "up")
        prefix = self.network.prefixlen
        gateway = str(next(iter(self.decoy_network.hosts())))
        for node in self.nodes:
            _ip("netns", "add", node.ns)
            self._namespaces.append(node.ns)
            (ETC_NETNS / node.ns).mkdir(parents=True, exist_ok=True)
            (ETC_NETNS / node.ns / "hosts").write_text(self.hosts_file(node))
            # No name server: every name is in hosts, and a query that went out
            # would leave the test's network (and wait for its time-out).
            (ETC_NETNS / node.ns / "resolv.conf").write_text("nameserver 127.0.0.1\n")
            decoy_end = f"{self.tag}d{node.rank}"
            # The decoy first, so that it is eth0, the interface listed first.
            _ip("link", "add", decoy_end, "type", "veth", "peer", "name", DECOY_IF, "netns", node.ns)
            self._links.append(decoy_end)
            _ip("link", "set", decoy_end, "up")
            _ip("link", "add", node.switch_port, "type", "veth", "peer", "name", CLUSTER_IF, "netns", node.ns)
            self._links.append(node.switch_port)
            _ip("link", "set", node.switch_port, "master", self.bridge, "up")
            n = ["-n", node.ns]
            _ip(*n, "link", "set", "lo", "up")
            _ip(*n, "addr", "add", f"{node.decoy_address}/{prefix}", "dev", DECOY_IF)
            _ip(*n, "link", "set", DECOY_IF, "up")
            _ip(*n, "addr", "add", f"{node.address}/{prefix}", "dev", CLUSTER_IF)
            _ip(*n, "link", "set", CLUSTER_IF, "up")
            _ip(*n, "route", "add", "default", "via", gateway, "dev", DECOY_IF)
        self._wait_reachable(20)

    def _wait_reachable(self, timeout: float) -> None:
        """Until every node's cluster address answers from node 0 (the
        bridge's ports take a moment to forward)."""
        end = time.monotonic() + timeout
        probe = (
            "import socket,sys\n"
            "for a in sys.argv[1:]:\n"
            "    s=socket.socket(); s.settimeout(0.5)\n"
            "    try: s.connect((a, 9))\n"
            "    except ConnectionRefusedError: pass\n"
            "    finally: s.close()\n"
        )
        others = [n.address for n in self.nodes[1:]]
        while True:
            done = subprocess.run(
                ["ip", "netns", "exec", self.nodes[0].ns, "python3", "-c", probe, *others],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if done.returncode == 0:
                return
            if time.monotonic() > end:
                raise RuntimeError(f"the nodes do not reach each other after {timeout:.0f}s: {done.stderr[-500:]}")
            time.sleep(0.1)

    def start_sshd(self, tmp: Path, timeout: float = 20) -> None:
        """Passwordless ssh between the nodes, as a cluster has it: a key made
        for the test, and on every node an sshd (Debian's openssh-server)
        listening on the node's address.  Each node's ``/etc/ssh`` is a folder
        of the test's (``ip netns exec`` mounts it): the client trusts the
        test's host key and offers the test's key, so nothing in the
        machine's own ``/etc/ssh`` or ``~/.ssh`` is read or written."""
        missing = [p for p in ("/usr/sbin/sshd", shutil.which("ssh-keygen") or "ssh-keygen") if not Path(p).exists()]
        if missing:
            raise RuntimeError(f"{', '.join(missing)} not installed (apt-get install openssh-server openssh-client)")
        keys = Path(tmp) / "ssh-keys"
        keys.mkdir(parents=True, exist_ok=True)
        for name in ("id_ed25519", "ssh_host_ed25519_key"):
            if not (keys / name).exists():
                subprocess.run(
                    ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", self.tag, "-f", str(keys / name)], check=True
                )
        (keys / "authorized_keys").write_text((keys / "id_ed25519.pub").read_text())
        host_pub = (keys / "ssh_host_ed25519_key.pub").read_text().split()[:2]
        known = "".join(f"{n.hostname},{n.address} {' '.join(host_pub)}\n" for n in self.nodes)
        (keys / "known_hosts").write_text(known)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
        for node in self.nodes:
            etc = ETC_NETNS / node.ns / "ssh"
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "ssh_config").write_text(
                "Host *\n"
                f"    IdentityFile {keys / 'id_ed25519'}\n"
                f"    UserKnownHostsFile {keys / 'known_hosts'}\n"
                "    GlobalKnownHostsFile /dev/null\n"
                "    StrictHostKeyChecking yes\n"
                "    BatchMode yes\n"
                "    ConnectTimeout 10\n"
                "    LogLevel ERROR\n"
            )
            (etc / "sshd_config").write_text(
                f"ListenAddress {node.address}\n"
                f"HostKey {keys / 'ssh_host_ed25519_key'}\n"
                f"PidFile {Path(tmp) / f'sshd-{node.hostname}.pid'}\n"
                f"AuthorizedKeysFile {keys / 'authorized_keys'}\n"
                "PermitRootLogin prohibit-password\n"
                "PasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\n"
                "UsePAM no\n"
                "StrictModes no\n"
                "PrintMotd no\n"
                "LogLevel INFO\n"
            )
            log = open(Path(tmp) / f"sshd-{node.hostname}.log", "w")
            self._daemons.append(
                subprocess.Popen(node.argv(["/usr/sbin/sshd", "-D", "-e"]), stdout=log, stderr=subprocess.STDOUT)
            )
            log.close()
        end = time.monotonic() + timeout
        for node in self.nodes:
            while True:
                done = self.nodes[0].run(["ssh", node.hostname, "true"], timeout=timeout)
                if done.returncode == 0:
                    break
                if time.monotonic() > end:
                    raise RuntimeError(f"ssh from n0 to {node.hostname} fails after {timeout:.0f}s: {done.stderr}")
                time.sleep(0.1)

    def spawn(self, node: Node, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        """``argv`` on ``node`` in the background, its output in ``.stdout``
        (text); ended with the cluster if still running."""
        proc = subprocess.Popen(
            node.argv(argv),
            cwd=Path(__file__).resolve().parents[2],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self._daemons.append(proc)
        return proc

    def set_link(self, node: Node, *, up: bool) -> None:
        """Plug ``node``'s cluster cable in or out (its switch port up or down)."""
        _ip("link", "set", node.switch_port, "up" if up else "down")

    def close(self) -> None:
        for proc in self._daemons:
            proc.kill()
            proc.wait()
        self._daemons.clear()
        _remove(self._namespaces, list(reversed(self._links)))
        self._namespaces.clear()
        self._links.clear()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------ jobs on the nodes
@dataclass(frozen=True)
class Job:
    """A command to run on a node."""

    node: Node
    argv: list[str]


@dataclass
class NodeResult:
    returncode: int
    output: str
    seconds: float
    #: time.monotonic() when the process ended (as polled, within 0.1 s).
    ended: float


def run_on_nodes(
    jobs: list[Job],
    env: dict[str, str],
    timeout: float,
    *,
    while_running=None,  # type: ignore[no-untyped-def]
    wait_all: bool = False,
    logs: dict[int, Path] | None = None,
) -> list[NodeResult]:
    """Start every job at once (each in a session of its own, output to a
    file) and wait for all.  A job that fails ends the others at once (their
    peers are gone), unless ``wait_all``; past ``timeout`` everything is
    killed and the test fails with each job's output.  ``while_running(procs)``
    acts on the running jobs (its time counts); ``logs`` receives the output
    files by job index, for it to read."""
    import tempfile

    import psutil
    import pytest

    folder = Path(tempfile.mkdtemp(prefix="netns-jobs-"))
    paths = [folder / f"job{i}.log" for i in range(len(jobs))]
    if logs is not None:
        logs.update(enumerate(paths))
    procs: list[subprocess.Popen] = []
    ended: dict[int, float] = {}
    start = time.monotonic()
    hung = False
    try:
        for job, path in zip(jobs, paths):
            with open(path, "w") as sink:
                procs.append(
                    subprocess.Popen(
                        job.node.argv(job.argv),
                        cwd=Path(__file__).resolve().parents[2],
                        env=env,
                        stdout=sink,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        if while_running is not None:
            while_running(procs)
        while True:
            now = time.monotonic()
            for i, p in enumerate(procs):
                if i not in ended and p.poll() is not None:
                    ended[i] = now
            if len(ended) == len(procs):
                break
            if not wait_all and any(p.returncode not in (None, 0) for p in procs):
                break
            if now - start > timeout:
                hung = True
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            try:
                children = psutil.Process(p.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                children = []
            for child in children:
                try:
                    child.kill()
                except psutil.NoSuchProcess:
                    pass
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    now = time.monotonic()
    results = [
        NodeResult(p.returncode, path.read_text(errors="replace").replace("\r", "\n"), now - start, ended.get(i, now))
        for i, (p, path) in enumerate(zip(procs, paths))
    ]
    shutil.rmtree(folder, ignore_errors=True)
    if hung:
        pytest.fail(f"the jobs ran past {timeout:.0f}s and were killed:\n{tails(results)}")
    return results


def tails(results: list[NodeResult], n: int = 40) -> str:
    return "\n".join(
        f"--- job {i} (exit {r.returncode}):\n" + "\n".join(r.output.splitlines()[-n:]) for i, r in enumerate(results)
    )
