"""parallelx.launching.network without a cluster: the interface rule over an in-memory
store with ranks as threads, the start-up errors from torch's own messages,
reachability over this machine's loopback, and ``env --network``'s report.
The same code across real namespaces: tests/system/test_netns.py."""

from __future__ import annotations

import json
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from parallelx.errors import LaunchError
from parallelx.launching import envreport, network
from parallelx.launching.environments.torchelastic import TorchElastic
from parallelx.launching.launchers import free_port

#: Two machines' tables: the master (n0) and another (n1), each with a decoy first.
N0 = {"lo": ["127.0.0.1"], "eth0": ["10.9.0.10"], "eth1": ["10.7.0.10"]}
N1 = {"lo": ["127.0.0.1"], "eth0": ["10.9.0.11"], "eth1": ["10.7.0.11"]}
T = timedelta(seconds=5)


def run_ranks(*calls):  # type: ignore[no-untyped-def]
    """Each call in a thread of its own (ranks); their results, or the exception each raised."""
    out: list[object] = [None] * len(calls)

    def one(i: int) -> None:
        try:
            out[i] = calls[i]()
        except Exception as exc:  # the test looks at it
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return out


# ------------------------------------------------------------ this machine
def test_this_machines_tables_and_the_route_to_the_loopback():
    table = network.interfaces()
    assert "127.0.0.1" in table["lo"]
    assert network.interface_holding("127.0.0.1", table) == "lo"
    assert network.interface_holding("10.200.0.1", {"x": ["10.200.0.2"]}) is None
    route = network.route_to("127.0.0.1")
    assert (route.address, route.source, route.interface, route.local) == ("127.0.0.1", "127.0.0.1", "lo", True)
    assert network.route_to("localhost").interface == "lo"
    assert network.is_loopback("127.0.1.1") and not network.is_loopback("10.7.0.10")
    assert "lo 127.0.0.1" in network.describe_table(table)


def test_a_name_that_does_not_resolve_is_one_clear_error(monkeypatch):
    def fail(*a, **k):  # type: ignore[no-untyped-def]
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", fail)
    with pytest.raises(network.NetworkError, match=r"'n9' does not resolve on this machine \(Name or service"):
        network.resolve("n9")
    join = network.GroupJoin(1, 2, "n9", 29500, T)
    with pytest.raises(LaunchError) as err:
        join.rendezvous()
    msg = str(err.value)
    assert msg.startswith("rank 1: MASTER_ADDR=n9: 'n9' does not resolve") and "--local-addr" in msg, msg


def test_the_users_own_interface_is_kept_once_it_exists():
    assert network.user_interface({}, N1) is None
    assert network.user_interface({"GLOO_SOCKET_IFNAME": "eth1"}, N1) == ("GLOO_SOCKET_IFNAME", "eth1")
    assert network.user_interface({"NCCL_SOCKET_IFNAME": "^docker,=eth1"}, N1) == ("NCCL_SOCKET_IFNAME", "eth1")
    assert network.user_interface({"NCCL_SOCKET_IFNAME": "eth"}, N1) == ("NCCL_SOCKET_IFNAME", "eth")  # a prefix
    with pytest.raises(network.NetworkError) as err:
        network.user_interface({"GLOO_SOCKET_IFNAME": "ib0"}, N1)
    assert "GLOO_SOCKET_IFNAME=ib0 names no interface of this machine (it has lo 127.0.0.1, eth0" in str(err.value)

    env = {"NCCL_SOCKET_IFNAME": "ib"}
    choice = network.export(network.Choice("eth1", "10.7.0.11", "why"), env)
    assert env == {"NCCL_SOCKET_IFNAME": "ib", "GLOO_SOCKET_IFNAME": "eth1"}
    assert choice.exported == ("GLOO_SOCKET_IFNAME",)


# ------------------------------------------------------------ the rule
def routes():  # type: ignore[no-untyped-def]
    """MASTER_ADDR n0 as each machine resolves it: n0 names itself 127.0.1.1 (Debian), n1 reaches 10.7.0.10."""
    on_n0 = network.Route("n0", "127.0.1.1", "127.0.0.1", "lo")
    on_n1 = network.Route("n0", "10.7.0.10", "10.7.0.11", "eth1")
    return on_n0, on_n1


def test_the_master_machine_takes_the_interface_the_others_dialed():
    store = dist.HashStore()
    on_n0, on_n1 = routes()
    r0, r1, r2 = run_ranks(
        lambda: network.agree_interface(store, 0, 3, "n0", T, host="n0", table=N0, route=on_n0),
        lambda: network.agree_interface(store, 1, 3, "n0", T, host="n0", table=N0, route=on_n0),
        lambda: network.agree_interface(store, 2, 3, "n0", T, host="n1", table=N1, route=on_n1),
    )
    for choice in (r0, r1):  # both ranks of the master's machine
        assert isinstance(choice, network.Choice), choice
        assert (choice.interface, choice.address, choice.spans_machines) == ("eth1", "10.7.0.10", True)
        assert "the address n1 dialed for MASTER_ADDR n0" in choice.why
    assert isinstance(r2, network.Choice)
    assert (r2.interface, r2.address, r2.why) == ("eth1", "10.7.0.11", "the route to MASTER_ADDR n0 (10.7.0.10)")
    # Every rank left its address for a later diagnosis.
    assert json.loads(store.get("parallelx/net/rank/2"))["address"] == "10.7.0.11"
    assert json.loads(store.get("parallelx/net/rank/0"))["address"] == "10.7.0.10"


def test_one_machine_keeps_the_loopback_and_says_nothing():
    store = dist.HashStore()
    on_n0, _ = routes()
    results = run_ranks(
        *(lambda r=r: network.agree_interface(store, r, 2, "n0", T, host="n0", table=N0, route=on_n0) for r in (0, 1))
    )
    for c in results:
        assert isinstance(c, network.Choice), c
        assert (c.interface, c.spans_machines) == ("lo", False)
        assert "the job's only one" in c.why
    join = network.GroupJoin(0, 2, "n0", 29500, T)
    join.choice = results[0]  # type: ignore[assignment]
    assert join.machine_line() is None


def test_a_translated_address_is_answered_by_the_route_back(monkeypatch):
    """The other machine dialed 172.16.0.10 (a NAT address the master does not hold):
    the master takes the interface of its route back to the dialer."""
    store = dist.HashStore()
    store.set("parallelx/net/remote", json.dumps({"host": "n1", "dialed": "172.16.0.10", "source": "10.7.0.11"}))
    store.add("parallelx/net/arrived", 1)
    monkeypatch.setattr(network, "source_address", lambda a: "10.7.0.10" if a == "10.7.0.11" else "127.0.0.1")
    choice = network.agree_interface(store, 0, 2, "n0", T, host="n0", table=N0, route=routes()[0])
    assert (choice.interface, choice.address) == ("eth1", "10.7.0.10")
    assert "the route back to n1 (10.7.0.11)" in choice.why


def test_a_master_machine_that_nobody_else_reaches_fails_within_the_timeout():
    store = dist.HashStore()
    start = time.monotonic()
    with pytest.raises(network.NetworkError) as err:
        network.agree_interface(store, 0, 2, "n0", timedelta(seconds=0.5), table=N0, route=routes()[0])
    assert time.monotonic() - start < 3
    assert "MASTER_ADDR n0 is this machine (127.0.1.1), and no rank of another machine reached it" in str(err.value)


def test_a_route_through_an_address_no_interface_holds_is_refused():
    route = network.Route("n0", "10.7.0.10", "10.5.5.5", None)
    with pytest.raises(network.NetworkError, match="which no interface of this machine holds"):
        network.agree_interface(dist.HashStore(), 1, 2, "n0", T, table=N1, route=route)


def test_the_users_variable_wins_and_the_machine_line_names_it(monkeypatch):
    store = dist.HashStore()
    store.set("parallelx/net/remote", "{}")  # not read: this rank is on another machine
    monkeypatch.setattr(network, "interfaces", lambda: N1)
    monkeypatch.setattr(network, "route_to", lambda master, table=None: routes()[1])
    env = {"GLOO_SOCKET_IFNAME": "eth0"}
    join = network.GroupJoin(1, 2, "n0", 29500, T)
    choice = join.choose_interface(store, env)
    assert (
        choice is not None and choice.interface == "eth0" and "GLOO_SOCKET_IFNAME=eth0, set by the user" in choice.why
    )
    assert env["NCCL_SOCKET_IFNAME"] == "eth0"  # the other variable follows the user's choice
    line = join.machine_line()
    assert line is not None and "collectives over eth0 (10.9.0.11)" in line and "NCCL_SOCKET_IFNAME set to eth0" in line


# ------------------------------------------------------------ errors at start-up
def test_start_up_failures_become_one_line_with_address_port_and_what_to_check():
    port = free_port()
    join = network.GroupJoin(0, 2, "127.0.0.1", port, timedelta(seconds=20))
    in_use = RuntimeError(f"The server socket has failed to listen ... port: {port}, code: -98, name: EADDRINUSE")
    msg = str(join._rendezvous_failure(in_use))
    assert f"port {port} is already in use on this machine" in msg and f"127.0.0.1:{port}" in msg
    assert "choose a free port" in msg and "\n" not in msg

    waiting = RuntimeError("Timed out after 21 seconds waiting for clients. 1/2 clients joined.")
    msg = str(join._rendezvous_failure(waiting))
    assert msg.startswith(f"rank 0: only 1 of 2 ranks reached the rendezvous at 127.0.0.1:{port}") and "20s" in msg

    # A client whose master answers but has nothing on the port (this machine: refused at once).
    client = network.GroupJoin(1, 2, "127.0.0.1", port, timedelta(seconds=20))
    msg = str(client._rendezvous_failure(RuntimeError("The client socket has timed out after 20000ms")))
    assert f"the rendezvous at 127.0.0.1:{port} (MASTER_ADDR:MASTER_PORT) could not be reached within 20s" in msg
    assert f"127.0.0.1 answers but nothing listens on port {port}" in msg
    assert "(here MASTER_ADDR is this machine itself)" in msg and "env --network" in msg

    # Gloo's own connections: where the ranks met but could not reach each other.
    mesh = client._mesh_failure(RuntimeError("Gloo connectFullMesh failed with ... Connection refused"))
    assert "could not connect to each other" in str(mesh) and "GLOO_SOCKET_IFNAME" in str(mesh)
    assert client._rendezvous_failure(KeyError("unrelated")) is None


def test_the_translation_keeps_launch_errors_and_unknown_failures():
    join = network.GroupJoin(0, 2, "127.0.0.1", free_port(), T)
    with pytest.raises(LaunchError, match="mine"), join.connecting():
        raise LaunchError("mine")
    with pytest.raises(ValueError), join.connecting():
        raise ValueError("not a network failure")


# ------------------------------------------------------------ reachability
def test_probe_tells_open_from_refused_and_probes_in_parallel():
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
        assert network.probe("127.0.0.1", port).state == "open"
    closed = free_port()
    reach = network.probe("127.0.0.1", closed)
    assert reach.state == "refused" and reach.machine_answers
    assert "answers but nothing listens" in reach.describe()
    start = time.monotonic()
    assert [r.state for r in network.probe_all([("127.0.0.1", closed)] * 3)] == ["refused"]  # one per target
    assert time.monotonic() - start < 1


def test_lost_peers_are_named_from_the_store_and_a_dead_store_does_not_hold_up(monkeypatch):
    store = dist.HashStore()
    store.set("parallelx/net/rank/1", json.dumps({"host": "n1", "address": "10.7.0.11"}))
    store.set("parallelx/net/rank/2", json.dumps({"host": "n1", "address": "10.7.0.11"}))
    store.set("parallelx/net/rank/3", json.dumps({"host": "n0", "address": "10.7.0.10"}))  # this machine

    def silent(targets, timeout=2.0):  # type: ignore[no-untyped-def]
        return [network.Reach(a, p, "silent", "no reply within 2s") for a, p in targets]

    monkeypatch.setattr(network, "probe_all", silent)
    monkeypatch.setattr(network, "resolve", lambda host: "10.7.0.10")
    lost = network.unreachable_peers(store, 0, 4, ("n0", 29500), own=["10.7.0.10", "127.0.0.1"])
    assert [x.describe() for x in lost] == ["10.7.0.11 (n1, ranks 1, 2) does not answer (no reply within 2s)"]

    class Hung:
        def check(self, keys):  # type: ignore[no-untyped-def]
            time.sleep(30)

    monkeypatch.setattr(network, "PROBE_TIMEOUT_S", 0.3)
    monkeypatch.setattr(network, "resolve", lambda host: "10.7.0.10")
    start = time.monotonic()
    lost = network.unreachable_peers(Hung(), 1, 2, ("n0", 29500), own=["10.7.0.11"])  # type: ignore[arg-type]
    assert time.monotonic() - start < 2
    assert [(x.address, x.who, x.master) for x in lost] == [("10.7.0.10", "MASTER_ADDR n0", True)]


def test_torchrun_agents_are_left_alone_unless_cut_off_on_their_last_attempt():
    env = TorchElastic(
        {"TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_RESTART_COUNT": "1"}
    )
    assert env.restarts_left() == 1
    assert "torchrun restarts the workers (1 restart(s) left)" in env.after_network_loss(master_answers=False)
    last = TorchElastic(
        {"TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RESTART_COUNT": "0"}
    )
    assert last.after_network_loss(master_answers=True).startswith("once it is back, run the same command")
    # The parent of this test process is no torchrun agent: it is never signalled.
    assert not last._agent_is_parent()
    assert "ended it" not in last.after_network_loss(master_answers=False)


def test_horovod_refuses_a_host_name_on_the_loopback_across_machines(monkeypatch):
    from backends.horovod import host_name_problem

    assert host_name_problem({"HOROVOD_CROSS_SIZE": "1"}, host="localhost") is None
    # Two names of this machine (horovodrun --network-interface lo): the loopback is right.
    assert host_name_problem({"HOROVOD_CROSS_SIZE": "2", "HOROVOD_GLOO_IFACE": "lo"}, host="localhost") is None
    msg = host_name_problem({"HOROVOD_CROSS_SIZE": "2", "HOROVOD_GLOO_IFACE": "eth9"}, host="localhost")
    assert msg is not None and "host name localhost resolves to 127.0.0.1" in msg
    assert "HOROVOD_GLOO_IFACE=eth9" in msg and "(the line `<its address> localhost`)" in msg
    monkeypatch.setattr(network, "resolve", lambda host: "10.7.0.11")
    assert host_name_problem({"HOROVOD_CROSS_SIZE": "2"}, host="n1") is None


# ------------------------------------------------------------ env --network
def test_env_network_on_the_master_machine_finds_a_free_port_and_a_taken_one():
    port = free_port()
    lines, fixes = envreport.network_lines("127.0.0.1", port, environ={})
    text = "\n".join(lines)
    assert "MASTER_ADDR   127.0.0.1 -> 127.0.0.1 (the options): this machine, rank 0's" in text
    assert f"port          {port}: free here" in text
    assert not [f for f in fixes if "port" in f]
    with socket.create_server(("", port)):
        lines, fixes = envreport.network_lines("127.0.0.1", port, environ={})
    assert any(f.startswith(f"fix: port {port} is taken on this machine") for f in fixes), fixes
    lines, fixes = envreport.network_lines("127.0.0.1", port, environ={"GLOO_SOCKET_IFNAME": "nosuch9"})
    assert any("GLOO_SOCKET_IFNAME=nosuch9 names no interface" in f for f in fixes), fixes


def test_env_network_answers_the_other_machines_with_its_name_and_clock():
    port = free_port()
    served: list[object] = []
    server = threading.Thread(target=lambda: served.append(envreport._serve(port, 1.5, "n0")))
    server.start()
    time.sleep(0.3)
    reach, answer, offset = envreport._ask("127.0.0.1", port)
    server.join(5)
    assert reach.state == "open" and answer is not None and answer["host"] == "n0"
    assert abs(offset) < 0.5, offset
    assert served == [(None, [("127.0.0.1", "127.0.0.1")])]


def test_master_address_comes_from_the_options_the_variables_or_this_machine():
    assert envreport.master_from({}, "n0", 1234) == ("n0", 1234, "the options")
    assert envreport.master_from({"MASTER_ADDR": "n0", "MASTER_PORT": "99"}, None, None)[:2] == ("n0", 99)
    assert envreport.master_from({}, None, None) == ("127.0.0.1", 29500, "nothing set: this machine")
