"""``python -m parallelx env``: what is installed here and which backends can run.

Each backend is checked in a fresh subprocess (importing DeepSpeed or a
mis-built Horovod can be slow or crash), the way ``ds_report`` and
``horovodrun --check-build`` do for their own packages.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Protocol

import torch

from parallelx.errors import LaunchError
from parallelx.launching import network
from parallelx.launching.environments import detect_environment
from parallelx.launching.runner import Runnable, unavailable


def _probe(code: str, timeout: float = 120.0) -> tuple[bool, str]:
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return False, f"import timed out after {timeout:.0f}s"
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        return False, lines[-1] if lines else f"exit code {proc.returncode}"
    out = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    return True, out[-1] if out else "ok"


# Each probe's code in turn in one interpreter (torch is imported once, not once per backend), a JSON line per
# probe as it ends.  An exception is that probe's failure; a crash (a mis-built extension) ends the interpreter, and
# the probes it did not answer are run again one per process, so that the crash is pinned on its own backend.
_ALL_PROBES = """
import contextlib, io, json, sys
for name, code in json.loads(sys.argv[1]).items():
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, name, "exec"), {})
        lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
        row = [name, True, lines[-1] if lines else "ok"]
    except BaseException as exc:
        row = [name, False, f"{type(exc).__name__}: {exc}"]
    print(json.dumps(row), flush=True)
"""


def _probe_all(codes: Mapping[str, str], timeout: float = 240.0) -> dict[str, tuple[bool, str]]:
    """``{backend: (ok, detail)}`` for every probe in ``codes``."""
    results: dict[str, tuple[bool, str]] = {}
    if codes:
        try:
            proc = subprocess.run(
                [sys.executable, "-c", _ALL_PROBES, json.dumps(dict(codes))],
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
            stdout = proc.stdout
        except subprocess.TimeoutExpired as exc:
            stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        for line in stdout.splitlines():
            try:
                name, ok, detail = json.loads(line)
            except ValueError:
                continue  # a package's own output on the real stdout
            if name in codes:
                results[name] = (bool(ok), str(detail))
    for name, code in codes.items():
        if name not in results:
            results[name] = _probe(code)
    return results


class Probed(Runnable, Protocol):
    """A backend as the report reads it (:class:`parallelx.strategy.BackendSpec`)."""

    @property
    def probe_code(self) -> str | None: ...


#: Each registered backend's description, or why it cannot be loaded (the registry, above this module, hands them in).
Described = Mapping[str, "Probed | Exception"]


def report(backends: Described) -> list[tuple[str, bool, str, str]]:
    """``(backend, usable, detail, launch line)`` for every registered backend."""
    rows: list[tuple[str, bool | None, str, str]] = []
    codes: dict[str, str] = {}
    for name, spec in backends.items():
        if isinstance(spec, Exception):  # a broken third-party entry point
            rows.append((name, False, f"cannot load: {spec}", ""))
            continue
        launch = spec.launcher.usage("-m your.module")
        reason = unavailable(spec)
        if reason is not None:
            rows.append((name, False, reason, launch))
        elif spec.probe_code:
            codes[name] = spec.probe_code
            rows.append((name, None, "", launch))
        else:
            rows.append((name, True, "ok", launch))
    probed = _probe_all(codes)
    out = []
    for name, ok, detail, launch in rows:
        if ok is None:
            ok, detail = probed[name]
        out.append((name, ok, detail, launch))
    return out


def versions() -> dict[str, str | None]:
    """Python's version and those of the packages parallelx works with (None:
    not installed), read from their metadata: nothing heavy is imported."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("torch", "torchvision", "deepspeed", "horovod", "ray", "parallelx"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def hardware() -> dict[str, Any]:
    """The machine a measurement ran on: CPU model, the cores this process may
    use (its affinity, not the machine's count), memory, the GPUs' names."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")),
        platform.processor() or platform.machine(),
    )
    pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return {
        "arch": platform.machine(),
        "cpu": cpu,
        "os": platform.platform(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * pages / 2**30, 1) if pages else None,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else [],
    }


def cluster_lines(auto: str) -> list[str]:
    """The cluster environment detected here, why, the world it forms and the
    backend ``--backend auto`` picks (``auto``); an environment whose variables do not
    add up says so instead of a world."""
    env = detect_environment()
    lines = [f"cluster environment: {env.name} ({env.why()}); --backend auto picks {auto}"]
    try:
        w = env.world()
    except LaunchError as exc:
        return [*lines, f"  no world: {exc}"]
    where = f", rendezvous {w.master_addr}:{w.master_port}" if w.master_addr else ""
    owner = f"; the process group is {env.name}'s (adopted, left to it)" if env.owns_process_group else ""
    return [
        *lines,
        f"  this process: rank {w.rank} of {w.world_size}, local rank {w.local_rank} of "
        f"{w.local_world_size}{where}{owner}",
    ]


def main(backends: Described, auto: str) -> int:
    """``python -m parallelx env``: versions, devices, the cluster environment, and each backend's probe."""
    print(f"python      {platform.python_version()} ({platform.machine()})")
    print(f"torch       {torch.__version__} (CUDA build {torch.version.cuda or 'none'})")
    try:
        import torchvision

        print(f"torchvision {torchvision.__version__}")
    except ImportError:
        print("torchvision not installed")
    cuda = torch.cuda.is_available()
    print(f"cuda        {'available, ' + str(torch.cuda.device_count()) + ' device(s)' if cuda else 'not available'}")
    print(
        f"nccl        {'yes' if cuda and torch.distributed.is_nccl_available() else 'no'}; "
        f"gloo {'yes' if torch.distributed.is_gloo_available() else 'no'}"
    )
    print()
    for line in cluster_lines(auto):
        print(line)
    print("\nbackends:")
    for name, ok, detail, launch in report(backends):
        print(f"  [{'OK' if ok else '--'}] {name:<10} {detail}")
        if launch:
            print(f"       {'':<10} launch: {launch}")
    return 0


# ------------------------------------------------------------------ --network
#: The first bytes of the answer ``env --network --wait`` gives on the master's port.
_GREETING = "parallelx-env-network "
#: Clocks further apart than this are a problem: torchrun's c10d rendezvous compares
#: heartbeat times taken on different machines (a machine whose heartbeats look
#: 15 s old is dropped), munge (Slurm) refuses credentials from beyond 5 minutes.
CLOCK_LIMIT_S = 5.0


def master_from(environ: Mapping[str, str], addr: str | None, port: int | None) -> tuple[str, int, str]:
    """``(MASTER_ADDR, MASTER_PORT, where from)``: the options, else the
    variables, else the world of the detected cluster environment (srun's
    first node), else this machine and torch's default port."""
    if addr and port:
        return addr, port, "the options"
    world = None
    try:
        world = detect_environment(environ, []).world()
    except LaunchError:
        pass
    env_addr = environ.get("MASTER_ADDR") or (world.master_addr if world else None)
    env_port = environ.get("MASTER_PORT") or (world.master_port if world else None)
    where = "MASTER_ADDR/MASTER_PORT" if environ.get("MASTER_ADDR") else "the cluster environment"
    if not (addr or env_addr):
        where = "nothing set: this machine"
    return addr or env_addr or "127.0.0.1", int(port or env_port or 29500), where if not addr else "the options"


def _serve(port: int, wait_s: float, host: str) -> tuple[str | None, list[tuple[str, str]]]:
    """Hold ``port`` for ``wait_s`` seconds, answering every connection with
    this machine's name and clock.  ``(error, [(peer, address it dialed)])``;
    error: the port cannot be bound."""
    try:
        srv = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    except OSError:
        try:
            srv = socket.create_server(("", port))
        except OSError as exc:
            return (exc.strerror or str(exc)), []
    seen: list[tuple[str, str]] = []
    end = time.monotonic() + wait_s
    with srv:
        while time.monotonic() < end:
            srv.settimeout(max(0.05, min(0.5, end - time.monotonic())))
            try:
                conn, peer = srv.accept()
            except TimeoutError:
                continue
            with conn:
                dialed = conn.getsockname()[0].removeprefix("::ffff:")
                who = peer[0].removeprefix("::ffff:")
                answer = {"host": host, "time": time.time(), "dialed": dialed, "peer": who}
                try:
                    conn.sendall((_GREETING + json.dumps(answer) + "\n").encode())
                except OSError:
                    continue
                seen.append((who, dialed))
    return None, seen


def _ask(address: str, port: int) -> tuple[network.Reach, dict[str, Any] | None, float]:
    """Dial ``address:port``; when ``env --network --wait`` answers there:
    its name, clock and what it saw, and this machine's clock offset from it."""
    sent = time.time()
    try:
        conn = socket.create_connection((address, port), timeout=network.PROBE_TIMEOUT_S)
    except OSError:
        return network.probe(address, port), None, 0.0  # again, to tell refused from silent
    reach = network.Reach(address, port, "open")
    with conn:
        try:
            data = conn.makefile("rb").readline(4096).decode(errors="replace")
        except OSError:
            return reach, None, 0.0
    got = time.time()
    if not data.startswith(_GREETING):
        return reach, None, 0.0  # something else listens there: the job's own store, perhaps
    answer = json.loads(data[len(_GREETING) :])
    # This clock minus the master's, taken half-way through the exchange.
    return reach, answer, (sent + got) / 2 - float(answer["time"])


def network_lines(
    addr: str | None = None,
    port: int | None = None,
    wait_s: float = 0.0,
    environ: Mapping[str, str] | None = None,
) -> tuple[list[str], list[str]]:
    """What ``python -m parallelx env --network`` prints: ``(lines, fixes)``,
    one ``fix:`` line per problem found (none: nothing to fix)."""
    environ = os.environ if environ is None else environ
    host = socket.gethostname()
    master, mport, source = master_from(environ, addr, port)
    lines = [f"network, from {host}:"]
    fixes: list[str] = []
    table = network.interfaces()
    lines.append(f"  interfaces    {network.describe_table(table)}")

    # ---- the master's address and port
    try:
        route = network.route_to(master, table)
    except network.NetworkError as exc:
        lines.append(f"  MASTER_ADDR   {master} ({source}): {exc}")
        fixes.append(
            f"fix: set MASTER_ADDR to the address of the machine of rank 0 as this machine reaches it (now {master})"
        )
        route = None
    user = None
    try:
        user = network.user_interface(environ, table)
    except network.NetworkError as exc:
        fixes.append(f"fix: {exc}")
    if route is not None and route.local:
        lines.append(f"  MASTER_ADDR   {master} -> {route.address} ({source}): this machine, rank 0's")
        error, seen = _serve(mport, wait_s, host)
        if error:
            lines.append(f"  port          {mport}: cannot be used here ({error})")
            fixes.append(
                f"fix: port {mport} is taken on this machine (another job, or an earlier run still going): choose "
                "another MASTER_PORT (torchrun --master-port / --rdzv-endpoint, deepspeed --master_port), or end "
                "the process that holds it"
            )
        elif wait_s > 0:
            who = ", ".join(f"{peer} (dialed {dialed})" for peer, dialed in seen) or "nobody"
            lines.append(f"  port          {mport}: free here; in {wait_s:g} s it was reached by {who}")
        else:
            lines.append(
                f"  port          {mport}: free here (run with --wait 60 here while the other machines run "
                "`python -m parallelx env --network`, to see them reach it)"
            )
        dialed = [d for p, d in seen if not network.is_loopback(p)]
        name = network.interface_holding(dialed[0], table) if dialed else None
        if user is not None:
            lines.append(f"  collectives   {user[1]}: {user[0]}={environ[user[0]]}, set by the user")
        elif name:
            lines.append(
                f"  collectives   {name} ({dialed[0]}): the address the other machines dialed; parallelx sets "
                f"GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME to {name}"
            )
        else:
            lines.append(
                "  collectives   the interface holding the address the other machines dial for MASTER_ADDR "
                "(learnt at start-up from them; the loopback when the job has no other machine)"
            )
    elif route is not None:
        lines.append(f"  MASTER_ADDR   {master} -> {route.address} ({source}), via {route.interface} ({route.source})")
        reach, answer, offset = _ask(route.address, mport)
        if reach.state == "open":
            where = f" (parallelx env --network --wait on {answer['host']})" if answer else ""
            lines.append(f"  reachable     yes: {route.address}:{mport} accepts connections{where}")
        elif reach.state == "refused":
            lines.append(f"  reachable     the machine answers, but nothing listens on port {mport} yet")
            fixes.append(
                f"fix: start rank 0 (or `python -m parallelx env --network --wait 60` on {master}) and run this "
                f"again; if it runs, it listens on another port than {mport}: make MASTER_PORT the same everywhere"
            )
        else:
            lines.append(f"  reachable     no: {reach.describe()}")
            fixes.append(
                f"fix: {master} ({route.address}) does not answer from here: check that it is rank 0's machine's "
                f"address as this machine sees it, that the machine is up, and that no firewall drops port {mport}"
            )
        if user is not None:
            lines.append(f"  collectives   {user[1]}: {user[0]}={environ[user[0]]}, set by the user")
            if user[1] != route.interface:
                fixes.append(
                    f"fix: {user[0]}={environ[user[0]]} is not the interface that reaches MASTER_ADDR "
                    f"({route.interface}): unset it, or set it to {route.interface}"
                )
        else:
            lines.append(
                f"  collectives   {route.interface} ({route.source}): the route to MASTER_ADDR; parallelx sets "
                f"GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME to {route.interface}"
            )
        if answer is not None:
            lines.append(
                f"  clock         {offset:+.2f} s from {answer['host']}'s"
                + (" (more than 5 s)" if abs(offset) > CLOCK_LIMIT_S else "")
            )
            if abs(offset) > CLOCK_LIMIT_S:
                fixes.append(
                    f"fix: this clock is {offset:+.0f} s off {answer['host']}'s: torchrun's c10d rendezvous drops "
                    "machines whose heartbeats look older than 15 s and munge (Slurm) refuses credentials from "
                    "beyond 5 minutes; synchronise the clocks (chrony, systemd-timesyncd)"
                )
        else:
            lines.append(
                "  clock         not compared (run `python -m parallelx env --network --wait 60` on the master "
                "machine at the same time)"
            )

    # ---- this machine's name, as launchers use it
    try:
        own = network.resolve(host)
    except network.NetworkError:
        own = None
    reach_addr = route.source if route is not None and not route.local else None
    if own is None:
        lines.append(f"  host name     {host}: does not resolve here")
        fixes.append(
            f"fix: add `{reach_addr or '<this machine address>'} {host}` to /etc/hosts: torchrun's c10d "
            "rendezvous gives the other machines this name, and Horovod connects over its address"
        )
    elif network.is_loopback(own):
        lines.append(f"  host name     {host} -> {own}, a loopback address")
        fixes.append(
            f"fix: map {host} to {reach_addr or 'the address the other machines reach'} in /etc/hosts (the line "
            f"`{reach_addr or '<address>'} {host}`) for Horovod (its process sets connect over the host name's "
            "address) and torchrun (its c10d rendezvous gives the other machines this name; or start it with "
            f"--local-addr {reach_addr or '<address>'}); parallelx's own process groups do not need it"
        )
    else:
        lines.append(f"  host name     {host} -> {own}")
    return lines, fixes


def network_main(addr: str | None, port: int | None, wait_s: float) -> int:
    """``python -m parallelx env --network``: exit status 1 when something needs fixing."""
    lines, fixes = network_lines(addr, port, wait_s)
    print(*lines, sep="\n")
    if fixes:
        print(*fixes, sep="\n")
    else:
        print("nothing to fix")
    return 1 if fixes else 0
