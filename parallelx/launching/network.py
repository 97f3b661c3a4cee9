"""Which network interface reaches the other machines, and what to say when
a machine cannot be reached.

Gloo, unless told, advertises the address the machine's host name resolves
to.  On a Debian machine that is ``127.0.1.1`` (and inside a container or a
network namespace often ``127.0.0.1``): every other machine then dials its
own loopback and the job fails at start-up (``Gloo connectFullMesh failed
... Connection refused``).  NCCL, unless told, takes the first interface
that is up, which may be one that does not reach the other machines.

The rule parallelx applies (:func:`agree_interface`, at the process group's
join), when the user has not set ``GLOO_SOCKET_IFNAME`` /
``NCCL_SOCKET_IFNAME`` themselves (it then sets both):

1. the interface of the kernel's route from this machine to ``MASTER_ADDR``
   (the one holding the source address the kernel would use);
2. unless ``MASTER_ADDR`` is an address of this machine (rank 0's own node,
   which may well name itself by a loopback name): there the route says
   nothing, so the ranks agree through the rendezvous store
   (:func:`agree_interface`): every rank on another machine publishes the
   address it dialed, and this machine uses the interface that holds it (or,
   where that address was translated on the way, the route back to the
   rank that dialed); when no rank is on another machine, the job is on one
   machine and the route (the loopback, usually) is right.

A variable the user did set is kept, once checked against the machine's
interfaces.

Everything here is plain functions over the standard library (the kernel's
tables through ``ioctl`` and ``/proc``, sockets), so that ``python -m
parallelx env --network`` can run them before a job and the tests can run
them without a cluster.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import json
import re
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

from parallelx.errors import LaunchError

#: The variables that choose the interface of the collective libraries (Gloo: the CPU, Horovod's
#: Gloo controller goes by horovodrun's own; NCCL: GPUs).  DeepSpeed communicates through them too.
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
#: The seconds a reachability probe waits for an answer.
PROBE_TIMEOUT_S = 2.0
_SIOCGIFADDR = 0x8915
_KEY = "parallelx/net"


class NetworkError(LaunchError):
    """A machine or address of the job cannot be reached, or named wrong."""


# ----------------------------------------------------------- this machine
def interfaces() -> dict[str, list[str]]:
    """This machine's interfaces and their addresses (IPv4 first), from the
    kernel: ``{"lo": ["127.0.0.1", "::1"], "eth0": ["10.0.0.5"], ...}``.  An
    interface with no address is listed with an empty list."""
    table: dict[str, list[str]] = {}
    for _, name in socket.if_nameindex():
        table[name] = []
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                table[name].append(socket.inet_ntoa(packed[20:24]))
            except OSError:  # no IPv4 address
                pass
    inet6 = Path("/proc/net/if_inet6")
    if inet6.is_file():
        for line in inet6.read_text().splitlines():
            parts = line.split()
            if len(parts) == 6 and parts[5] in table:
                table[parts[5]].append(str(ipaddress.IPv6Address(bytes.fromhex(parts[0]))))
    return table


def interface_holding(address: str, table: Mapping[str, Iterable[str]]) -> str | None:
    """The interface of ``table`` that holds ``address`` (None: none does)."""
    want = ipaddress.ip_address(address)
    for name, addrs in table.items():
        if any(ipaddress.ip_address(a.split("%")[0]) == want for a in addrs):
            return name
    return None


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


def resolve(host: str) -> str:
    """``host`` (a name or an address) as one address, IPv4 preferred, as
    ``TCPStore`` dials it; :class:`NetworkError` when it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        raise NetworkError(f"{host!r} does not resolve on this machine ({reason})") from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return str(infos[0][4][0])


def source_address(address: str) -> str:
    """The address this machine sends from to reach ``address``: the
    kernel's route lookup (a UDP socket's ``connect``, which sends nothing)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((address, 9))
        return str(s.getsockname()[0])


@dataclass(frozen=True)
class Route:
    """How this machine reaches ``host``."""

    host: str  # as given (MASTER_ADDR)
    address: str  # what it resolves to here
    source: str  # this machine's address on the way
    interface: str | None  # the interface that holds ``source``

    @property
    def local(self) -> bool:
        """``host`` is this machine (a loopback address, or one of its own)."""
        return is_loopback(self.address) or self.source == self.address


def route_to(host: str, table: Mapping[str, Iterable[str]] | None = None) -> Route:
    """The route to ``host``; :class:`NetworkError` when it does not resolve or no route leads there."""
    address = resolve(host)
    try:
        source = source_address(address)
    except OSError as exc:
        raise NetworkError(
            f"{host} ({address}) cannot be reached from this machine: {exc.strerror or exc} (no route to it)"
        ) from None
    return Route(host, address, source, interface_holding(source, interfaces() if table is None else table))


# ------------------------------------------------------------ the choice
@dataclass(frozen=True)
class Choice:
    """The interface Gloo and NCCL use on this machine, and why."""

    interface: str
    address: str
    why: str
    #: Whether the job has ranks on other machines (as far as this rank learnt).
    spans_machines: bool = False
    #: The variables parallelx sets (those the user had not set).
    exported: tuple[str, ...] = ()

    def describe(self) -> str:
        return f"{self.interface} ({self.address}): {self.why}"


def user_interface(environ: Mapping[str, str], table: Mapping[str, Iterable[str]]) -> tuple[str, str] | None:
    """``(variable, interface)`` when the user chose the interface, checked
    against this machine's interfaces; :class:`NetworkError` names the
    interfaces there are when it names none of them."""
    for var in SOCKET_IFNAME_VARS:
        value = environ.get(var, "").strip()
        if not value:
            continue
        # Gloo takes a comma-separated list; NCCL a prefix list (^ excludes, = exact).
        names = [n.lstrip("=") for n in value.split(",") if n and not n.startswith("^")]
        known = [
            n for n in names if n in table or (var == "NCCL_SOCKET_IFNAME" and any(t.startswith(n) for t in table))
        ]
        if names and not known:
            raise NetworkError(
                f"{var}={value} names no interface of this machine (it has {_listing(table)}); "
                f"set it to the interface that reaches the other machines, or unset it and parallelx "
                "takes the one that routes to MASTER_ADDR"
            )
        if known:
            return var, known[0]
    return None


def _listing(table: Mapping[str, Iterable[str]]) -> str:
    return ", ".join(f"{name} {'/'.join(addrs) or '(no address)'}" for name, addrs in table.items())


class Store(Protocol):
    def set(self, key: str, value: str, /) -> None: ...
    def get(self, key: str, /) -> bytes: ...
    def add(self, key: str, value: int, /) -> int: ...
    def check(self, keys: list[str]) -> bool: ...


def agree_interface(
    store: Store,
    rank: int,
    world_size: int,
    master: str,
    timeout: timedelta,
    *,
    host: str | None = None,
    table: Mapping[str, Iterable[str]] | None = None,
    route: Route | None = None,
) -> Choice:
    """The interface this rank's collectives should use (the rule in the
    module's docstring), agreed with the other ranks through ``store``; each
    rank also leaves its address there for :func:`unreachable_peers`.
    ``table`` and ``route`` are this machine's (looked up when None)."""
    table = interfaces() if table is None else table
    route = route_to(master, table) if route is None else route
    record = {"host": host or socket.gethostname(), "dialed": route.address, "source": route.source}
    if not route.local:
        if route.interface is None:
            raise NetworkError(
                f"the route to MASTER_ADDR {master} ({route.address}) leaves from {route.source}, which no "
                f"interface of this machine holds ({_listing(table)}); set GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME "
                "on GPUs) to the interface that reaches the other machines"
            )
        # Published before this rank counts itself: see _master_side.
        store.set(f"{_KEY}/remote", json.dumps(record))
        store.add(f"{_KEY}/arrived", 1)
        choice = Choice(
            route.interface, route.source, f"the route to MASTER_ADDR {master} ({route.address})", spans_machines=True
        )
    else:
        store.add(f"{_KEY}/arrived", 1)
        choice = _master_side(store, world_size, master, route, timeout, table)
    store.set(f"{_KEY}/rank/{rank}", json.dumps({**record, "address": choice.address}))
    return choice


def _master_side(
    store: Store, world_size: int, master: str, route: Route, timeout: timedelta, table: Mapping[str, Iterable[str]]
) -> Choice:
    """On the machine MASTER_ADDR names: the interface that holds the address
    the ranks of other machines dialed, or the route's when there are none."""
    deadline = time.monotonic() + timeout.total_seconds()
    pause = 0.002
    while not store.check([f"{_KEY}/remote"]):
        # Every rank of another machine publishes its record before it counts
        # itself: all counted and none published means all are on this machine.
        if store.add(f"{_KEY}/arrived", 0) >= world_size and not store.check([f"{_KEY}/remote"]):
            if route.interface is None:
                raise NetworkError(f"no interface of this machine holds {route.source} ({_listing(table)})")
            return Choice(route.interface, route.source, f"MASTER_ADDR {master} is this machine, the job's only one")
        if time.monotonic() > deadline:
            raise NetworkError(
                f"MASTER_ADDR {master} is this machine ({route.address}), and no rank of another machine reached "
                f"it within {timeout.total_seconds():.0f}s, nor did all {world_size} ranks start here: check that "
                "the other machines were started with MASTER_ADDR set to an address of this one that they reach"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.1)
    remote = json.loads(store.get(f"{_KEY}/remote"))
    dialed, source = remote["dialed"], remote["source"]
    name = interface_holding(dialed, table)
    if name is not None and not is_loopback(dialed):
        return Choice(
            name, dialed, f"the address {remote['host']} dialed for MASTER_ADDR {master}", spans_machines=True
        )
    try:  # dialed through a translated address: the way back to the one that dialed
        back = source_address(source)
    except OSError:
        back = None
    name = interface_holding(back, table) if back else None
    if name is None or back is None or is_loopback(back):
        raise NetworkError(
            f"{remote['host']} reached MASTER_ADDR {master} at {dialed}, which is no address of this machine, "
            f"and no route leads back to it ({source}); set GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME on GPUs) to "
            f"the interface of this machine that the others reach (it has {_listing(table)})"
        )
    return Choice(
        name, back, f"the route back to {remote['host']} ({source}), which reached MASTER_ADDR {master}", True
    )


def export(choice: Choice, environ: Any) -> Choice:
    """Set the interface variables that are unset in ``environ`` to the choice's interface."""
    done = []
    for var in SOCKET_IFNAME_VARS:
        if not environ.get(var):
            environ[var] = choice.interface
            done.append(var)
    return Choice(choice.interface, choice.address, choice.why, choice.spans_machines, tuple(done))


# ---------------------------------------------------------- reachability
@dataclass(frozen=True)
class Reach:
    """What one TCP connection attempt to ``address:port`` found."""

    address: str
    port: int
    state: str  # "open", "refused" (the machine answers, nothing listens), "silent", "no route"
    detail: str = ""

    @property
    def machine_answers(self) -> bool:
        return self.state in ("open", "refused")

    def describe(self) -> str:
        return {
            "open": f"{self.address}:{self.port} accepts connections",
            "refused": f"{self.address} answers but nothing listens on port {self.port}",
            "silent": f"{self.address} does not answer ({self.detail})",
            "no route": f"{self.address} cannot be reached from this machine ({self.detail})",
        }[self.state]


def probe(address: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> Reach:
    """One TCP connection attempt: whether the machine at ``address`` answers
    and whether something listens on ``port``."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect((address, port))
        except ConnectionRefusedError:
            return Reach(address, port, "refused")
        except TimeoutError:
            return Reach(address, port, "silent", f"no reply within {timeout:g}s")
        except OSError as exc:
            if exc.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL):
                return Reach(address, port, "no route", exc.strerror or str(exc))
            return Reach(address, port, "silent", exc.strerror or str(exc))
    return Reach(address, port, "open")


def probe_all(targets: Iterable[tuple[str, int]], timeout: float = PROBE_TIMEOUT_S) -> list[Reach]:
    """:func:`probe` of every target at once (threads): the whole takes at most ``timeout``."""
    targets = list(dict.fromkeys(targets))
    results: list[Reach | None] = [None] * len(targets)

    def one(i: int) -> None:
        results[i] = probe(*targets[i], timeout=timeout)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(targets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 1)
    return [r if r is not None else Reach(a, p, "silent", "no verdict") for r, (a, p) in zip(results, targets)]


#: At most this many ranks' addresses are read back after a failure.
PEERS_READ = 256


def peer_addresses(store: Store, world_size: int, rank: int) -> dict[str, list[int]]:
    """The addresses the other ranks left in the store at start-up, with
    their ranks: ``{"10.0.0.6": [1, 2], ...}`` (at most :data:`PEERS_READ`
    ranks; what cannot be read is left out)."""
    found: dict[str, list[int]] = {}
    for r in range(min(world_size, PEERS_READ)):
        if r == rank:
            continue
        key = f"{_KEY}/rank/{r}"
        try:
            if not store.check([key]):
                continue
            rec = json.loads(store.get(key))
        except Exception:  # the store itself may be unreachable now
            break
        found.setdefault(f"{rec['address']} ({rec['host']})", []).append(r)
    return found


@dataclass(frozen=True)
class Lost:
    """A machine of the job that does not answer: its address, who it is, what the probe found."""

    address: str
    who: str  # "n1, rank 1" or "MASTER_ADDR n0"
    reach: Reach
    master: bool = False

    def describe(self) -> str:
        return f"{self.address} ({self.who}) does not answer ({self.reach.detail})"


def unreachable_peers(
    store: Store | None, rank: int, world_size: int, master: tuple[str, int] | None, own: Iterable[str]
) -> list[Lost]:
    """After a failure: the machines of this job that do not answer from
    here (an empty list when every one does).  They are the addresses the
    ranks left in ``store`` at start-up and MASTER_ADDR's."""
    own = set(own)
    # The store is on a machine that may be the one gone, and a store call
    # waits for an answer with no time limit of its own: read in a thread,
    # and go on without it after the probe's time.
    found: dict[str, list[int]] = {}
    if store is not None:
        reader = threading.Thread(
            target=lambda: found.update(peer_addresses(store, world_size, rank)), name="parallelx-peers", daemon=True
        )
        reader.start()
        reader.join(PROBE_TIMEOUT_S)
        found = dict(found) if not reader.is_alive() else {}
    who: dict[str, str] = {}
    for key, ranks in found.items():
        address, host = key.split(" ", 1)
        if address not in own and not is_loopback(address):
            shown = ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
            who[address] = f"{host[1:-1]}, rank{'s' if len(ranks) > 1 else ''} {shown}"
    master_address = None
    if master is not None:
        try:
            master_address = resolve(master[0])
        except NetworkError:
            pass
        if master_address and master_address not in own and not is_loopback(master_address):
            who.setdefault(master_address, f"MASTER_ADDR {master[0]}")
    port = master[1] if master else 9
    silent = [r for r in probe_all([(a, port) for a in who]) if not r.machine_answers]
    return [Lost(r.address, who[r.address], r, r.address == master_address) for r in silent]


# ------------------------------------------------- joining a process group
class GroupJoin:
    """One rank's way into its process group, with the network in view:
    start-up failures become one line that names the address and port and
    says what to check, the interface is chosen (:func:`agree_interface`),
    and a failure later names the machines that no longer answer.

    ::

        join = GroupJoin(rank, world_size, master_addr, master_port, timeout)
        with join.rendezvous():
            store = ...                       # the rendezvous store
        join.choose_interface(store, os.environ)
        with join.connecting():
            dist.init_process_group(..., store=store)
        ...
        join.report_lost_peers()              # after a failure
    """

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, timeout: timedelta) -> None:
        self.rank, self.world_size = rank, world_size
        self.master_addr, self.master_port = master_addr, master_port
        self.timeout = timeout
        self.choice: Choice | None = None
        self._store: Store | None = None

    @property
    def where(self) -> str:
        return f"{self.master_addr}:{self.master_port}"

    def rendezvous(self) -> _Translate:
        """Around the store's creation: an unresolvable MASTER_ADDR fails at
        once, and a rendezvous that cannot be reached or served fails with
        what was found at MASTER_ADDR:MASTER_PORT."""
        try:
            resolve(self.master_addr)
        except NetworkError as exc:
            raise NetworkError(
                f"rank {self.rank}: MASTER_ADDR={self.master_addr}: {exc}; set MASTER_ADDR to the address of the "
                "machine of rank 0, or a name that every machine resolves (under torchrun, which sets it to rank "
                "0's host name: start it with --local-addr <the machine's address> on every machine)"
            ) from None
        return _Translate(self._rendezvous_failure)

    def _rendezvous_failure(self, exc: BaseException) -> NetworkError | None:
        text = str(exc)
        seconds = f"{self.timeout.total_seconds():.0f}s"
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            return NetworkError(
                f"rank {self.rank}: port {self.master_port} is already in use on this machine, so the rendezvous "
                f"cannot be served at {self.where} (MASTER_ADDR:MASTER_PORT); another job, or an earlier run of "
                "this one, holds it: choose a free port (MASTER_PORT, torchrun --master-port, deepspeed "
                "--master_port) or end the process that holds it"
            )
        joined = _clients_joined(text)
        if joined is not None:
            return NetworkError(
                f"rank {self.rank}: only {joined[0]} of {joined[1]} ranks reached the rendezvous at "
                f"{self.where} (MASTER_ADDR:MASTER_PORT) within {seconds}; check that the other machines were "
                f"started, with MASTER_ADDR={self.master_addr} resolving to this machine there and port "
                f"{self.master_port} open to them (`python -m parallelx env --network` on each machine tests it)"
            )
        if not isinstance(exc, (RuntimeError, TimeoutError, OSError)):
            return None
        try:
            reach = probe(resolve(self.master_addr), self.master_port)
        except NetworkError:
            return None
        if reach.state == "open":
            found = f"{self.where} accepts connections but did not serve the rendezvous ({_first_line(text)})"
            check = "that MASTER_PORT is the port of this job's rank 0, not of another program"
        elif reach.state == "refused":
            found = f"{reach.address} answers but nothing listens on port {self.master_port}"
            check = (
                f"that rank 0 has started on the machine MASTER_ADDR names"
                f"{' (here MASTER_ADDR is this machine itself)' if _is_own(reach.address) else ''}, "
                f"and on port {self.master_port}"
            )
        else:
            found = f"no answer from {reach.address} ({reach.detail})"
            check = (
                "that MASTER_ADDR is the address of rank 0's machine as this machine sees it, that the machine is "
                f"up, and that no firewall drops port {self.master_port} between the machines"
            )
        return NetworkError(
            f"rank {self.rank}: the rendezvous at {self.where} (MASTER_ADDR:MASTER_PORT) could not be reached "
            f"within {seconds}: {found}; check {check} (`python -m parallelx env --network` on this machine tests it)"
        )

    def choose_interface(self, store: Store, environ: Any) -> Choice | None:
        """Agree on the interface (:func:`agree_interface`) and set the
        variables the user left unset; the user's own are checked, kept, and
        still published for :meth:`report_lost_peers`."""
        self._store = store
        table = interfaces()
        user = user_interface(environ, table)
        choice = agree_interface(store, self.rank, self.world_size, self.master_addr, self.timeout, table=table)
        if user is not None:
            var, name = user
            addrs = [a for a in table.get(name, []) if ":" not in a] or list(table.get(name, []))
            choice = Choice(
                name, addrs[0] if addrs else "?", f"{var}={environ[var]}, set by the user", choice.spans_machines
            )
        self.choice = export(choice, environ)
        return self.choice

    def machine_line(self) -> str | None:
        """One line for the job's log, once per machine: the interface its
        collectives use and why, on a job that spans machines (None otherwise)."""
        c = self.choice
        if c is None or not c.spans_machines:
            return None
        done = f"; {' and '.join(c.exported)} set to {c.interface}" if c.exported else ""
        return f"parallelx: {socket.gethostname()}: collectives over {c.describe()}{done}"

    def connecting(self) -> _Translate:
        """Around the collective library's own connections (Gloo's full mesh)."""
        return _Translate(self._mesh_failure)

    def _mesh_failure(self, exc: BaseException) -> NetworkError | None:
        text = str(exc)
        if "connectFullMesh" not in text and "connect" not in text.lower():
            return None
        used = self.choice.describe() if self.choice else "the host name's address"
        return NetworkError(
            f"rank {self.rank}: the ranks met at {self.where} but could not connect to each other "
            f"({_first_line(text)}); this machine offered {used}: set GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME on "
            "GPUs) on every machine to the interface that reaches the others (`python -m parallelx env "
            "--network` shows them)"
        )

    def report_lost_peers(self, environment: Any = None, out: Any = None) -> list[Lost]:
        """After a failure: print one line naming the machines of the job that
        do not answer from here (nothing when all answer), and what becomes of
        the job (``environment.after_network_loss``); returns them."""
        own = [a for addrs in interfaces().values() for a in addrs]
        lost = unreachable_peers(self._store, self.rank, self.world_size, (self.master_addr, self.master_port), own)
        if lost:
            master_answers = not any(x.master for x in lost)
            then = (
                environment.after_network_loss(master_answers)
                if environment is not None
                else "once it is back, run the same command with --resume auto to continue from the last checkpoint"
            )
            here = f" ({self.choice.address})" if self.choice else ""
            print(
                f"parallelx: error: rank {self.rank} stopped on an error, and from this machine{here} "
                f"{'; '.join(x.describe() for x in lost)}: a machine of the job left the network or went down; "
                f"{then}",
                file=out or sys.stderr,
                flush=True,
            )
        return lost


class _Translate:
    """A context manager that replaces an exception by ``translate(exc)`` when that gives one."""

    def __init__(self, translate: Any) -> None:
        self.translate = translate

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None or isinstance(exc, LaunchError):
            return  # nothing to translate; None lets any exception through
        better = self.translate(exc)
        if better is not None:
            raise better from exc


def _clients_joined(text: str) -> tuple[int, int] | None:
    """``(joined, expected)`` from TCPStore's "N/M clients joined" (the server's wait for the
    others; the server counts itself)."""
    m = re.search(r"(\d+)/(\d+) clients joined", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _first_line(text: str) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), text)
    return line if len(line) <= 240 else line[:237] + "..."


def _is_own(address: str) -> bool:
    return is_loopback(address) or any(address in addrs for addrs in interfaces().values())


def describe_table(table: Mapping[str, Iterable[str]]) -> str:
    """``lo 127.0.0.1, eth0 10.0.0.5`` (IPv6 link-local addresses left out)."""
    return _listing({n: [a for a in addrs if not a.lower().startswith("fe80")] for n, addrs in table.items()})
