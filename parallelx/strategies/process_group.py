"""The ``torch.distributed`` base of the ``ddp``, ``fsdp`` and ``deepspeed``
backends: joining a process group (Gloo on the CPU, NCCL on GPUs) and the
collectives over it."""

from __future__ import annotations

import datetime as _dt
import os
import time
import uuid
from collections import deque
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn

from parallelx.errors import LaunchError
from parallelx.forensics import record
from parallelx.launching import network
from parallelx.launching.environments import ClusterEnvironment
from parallelx.launching.launchers import free_port
from parallelx.log import warn
from parallelx.parts import lockstep
from parallelx.parts.collectives import Collectives, Watch, no_watch
from parallelx.parts.mesh import Mesh, check_degree, tensor_parallel_groups
from parallelx.strategy import Joined, Run, Strategy

T = TypeVar("T")

# Handles of the most recent torch.distributed collectives, kept until the
# interpreter itself frees them.  Gloo's worker thread drops its reference to a
# finished work after the caller has already returned; when that is the last
# reference, the worker destroys the work's tensors and takes the GIL to do it.
# If the script has meanwhile reached interpreter shutdown, Python ends that
# thread inside a C++ destructor and the process aborts ("terminate called
# without an active exception", exit -6) after all of its work was done.  A
# barrier also holds the works that were still in flight when it started, so
# holding the last few handles here leaves the worker nothing to destroy.
# Upstream: https://github.com/pytorch/pytorch/issues/190489
_RECENT_WORK: deque[Any] = deque(maxlen=16)


def wait(work: Any) -> None:
    """Wait for an ``async_op=True`` collective and keep its handle (see _RECENT_WORK)."""
    work.wait()
    _RECENT_WORK.append(work)


def restart_store(timeout: _dt.timedelta) -> dist.Store | None:
    """Under torchrun, a store of this attempt's own for the process group.

    torchrun's agents serve the workers one store for every restart of a job
    (the static rendezvous's, or the c10d rendezvous's shared TCP store); the
    keys the failed attempt's process group wrote there (each rank's address)
    are still in it, so a restarted rank can read a dead peer's address and
    fail to connect ("Connection refused" in Gloo's connectFullMesh), which
    spends another restart, and another.  Keys under a prefix that only this
    attempt knows keep the attempts apart.  The restart count cannot be that
    prefix: with several agents (``--nnodes``) one agent restarts for the
    failure and another for the change of membership, which torchrun does not
    count, so their counts differ.  :func:`attempt_token` agrees on one.
    None elsewhere: the launcher's ``env://`` rendezvous is used as it is."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT") is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    token = attempt_token(agent, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), timeout)
    return dist.PrefixStore(f"parallelx/attempt-{token}", agent)


def attempt_token(store: dist.Store, rank: int, world_size: int, timeout: _dt.timedelta) -> str:
    """A token that every rank of this attempt agrees on and no earlier
    attempt used, through a store that may hold any earlier attempt's keys.

    Rank 0 draws the token.  Every other rank draws a nonce of its own,
    publishes it under its rank and waits for the token under its nonce, which
    nobody else can have written.  Rank 0 answers whatever nonce each rank
    has published (at first perhaps a dead attempt's: that answer is never
    read) until the rank confirms under the new token."""
    prefix = "parallelx/attempts"
    if rank != 0:
        nonce = uuid.uuid4().hex
        store.set(f"{prefix}/hello/{rank}", nonce)
        token = store.get(f"{prefix}/welcome/{nonce}").decode()  # waits up to the store's timeout
        store.set(f"{prefix}/{token}/joined/{rank}", "1")
        return token
    token = uuid.uuid4().hex
    pending = set(range(1, world_size))
    deadline = time.monotonic() + timeout.total_seconds()
    pause = 0.005
    while pending:
        for r in sorted(pending):
            if store.check([f"{prefix}/{token}/joined/{r}"]):
                pending.discard(r)
            elif store.check([f"{prefix}/hello/{r}"]):
                store.set(f"{prefix}/welcome/{store.get(f'{prefix}/hello/{r}').decode()}", token)
        if pending:
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"rank 0: ranks {sorted(pending)[:8]} did not join this attempt's process group "
                    f"within {timeout.total_seconds():.0f}s"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.2)
    return token


class ProcessGroupCollectives(Collectives):
    """Collectives over ``torch.distributed``'s default process group (Gloo on
    the CPU, NCCL on GPUs)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        device: torch.device,
        watch: Watch = no_watch,
        timeout_s: float = 1800.0,
        group: Any = None,
    ) -> None:
        super().__init__(rank, world_size, watch)
        self.device = device
        #: A subgroup (the data-parallel ranks under tensor parallelism); None: the world.
        self.group = group
        # The agreements before a collective travel apart from the engines' collectives (see agree_);
        # a subgroup's through the subgroup.
        self.side = lockstep.side_group(timeout_s) if group is None else None

    def _src(self, src: int) -> int:
        return src if self.group is None else dist.get_global_rank(self.group, src)

    def agree_(self, table: torch.Tensor, device: torch.device) -> torch.Tensor:
        if self.side is None:
            return super().agree_(table, device)
        wait(dist.all_reduce(table, group=self.side, async_op=True))
        return table

    def comm_device(self, tensor: torch.Tensor) -> torch.device:
        # NCCL only reduces CUDA tensors; Gloo reduces CPU ones.
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def reduce_(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        wait(dist.all_reduce(tensor, op=red, group=self.group, async_op=True))
        return tensor

    def barrier(self) -> None:
        with self.watch("barrier"):
            wait(dist.barrier(group=self.group, async_op=True))

    def broadcast(self, obj: T, src: int = 0) -> T:
        with self.watch("broadcast"):
            record.describe(obj)
            if isinstance(obj, torch.Tensor):
                out = obj.detach().to(self.comm_device(obj), copy=True)
                self.agree_shapes("broadcast", out)
                wait(dist.broadcast(out, src=self._src(src), group=self.group, async_op=True))
                return cast(T, out.to(obj.device))
            box = [obj]
            dist.broadcast_object_list(
                box, src=self._src(src), group=self.group, device=self.device if self.device.type == "cuda" else None
            )
            return box[0]

    def all_gather_list(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        # dist.all_gather moves equal shapes only: every rank pads its rows to the longest.
        rows = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
        counts = [torch.empty_like(rows) for _ in range(self.world_size)]
        with self.watch("all_gather"):
            wait(dist.all_gather(counts, rows, group=self.group, async_op=True))
        sizes = [int(c) for c in counts]
        if max(sizes) == 0:
            return [tensor.clone() for _ in sizes]
        padded = tensor.new_zeros((max(sizes), *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        parts = [torch.empty_like(padded) for _ in sizes]
        with self.watch("all_gather"):
            record.describe(padded)
            wait(dist.all_gather(parts, padded, group=self.group, async_op=True))
        return [part[:n] for part, n in zip(parts, sizes)]


class ProcessGroupStrategy(Strategy):
    """A backend whose processes talk through ``torch.distributed``."""

    #: Variables the launcher must have set for ``init_process_group``.
    REQUIRED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    #: False where the process group was there before init() (a cluster
    #: environment made it): it is that environment's to destroy.
    owns_group = False
    #: How this process joined its group over the network (None: adopted, or not yet joined).
    net: network.GroupJoin | None = None

    def join(self) -> Joined:
        device = self.join_rendezvous()
        return self.read_world(device)

    def join_rendezvous(self) -> torch.device:
        """Pick the device and join the process group of this process's environment; returns the device.
        Started without a launcher, run as a world of one process (and say how to launch more), which
        keeps ``python train.py --backend NAME`` usable for debugging."""
        env = self.environment
        if env.name == "local":
            warn(
                f"{self.name}: no launcher found, running as a world of 1 process; for N processes start with "
                f"`{self.spec.launcher.usage()}`"
            )
            os.environ.update(
                RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
            )
        device = self.run.pick_device(env.world().local_rank)
        self.init_process_group(device)
        return device

    @property
    def environment(self) -> ClusterEnvironment:
        env = self.run.environment
        assert env is not None, "the facade detects the environment before join()"
        return env

    def init_process_group(self, device: torch.device) -> None:
        """Join the default process group of this process's cluster environment,
        or adopt the one that environment already made."""
        env, run = self.environment, self.run
        gpus = torch.cuda.device_count() if run.device_request != "cpu" and torch.cuda.is_available() else 0
        env.check_devices(gpus)
        if dist.is_initialized():  # adopted: owns_group stays False, the group is left to whoever made it
            if env.owns_process_group and run.timeout_explicit:
                where = env.group_timeout or f"{env.name}'s own"
                warn(
                    f"{self.name}: {env.name} made the process group before this script ran, so its timeout is "
                    f"not --timeout's {run.timeout_s:g}s but {where}"
                )
            return
        env.export()  # the torch.distributed variables, where the environment names them otherwise
        missing = [k for k in self.REQUIRED_ENV if k not in os.environ]
        if missing:
            raise LaunchError(
                f"{self.name}: the environment lacks {', '.join(missing)}; start the script with "
                f"`{self.spec.launcher.usage()}`"
            )
        timeout = _dt.timedelta(seconds=run.timeout_s)
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.net = network.GroupJoin(
            rank, world_size, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout
        )
        with self.net.rendezvous():
            store = restart_store(timeout)
            if store is None:  # what init_process_group's env:// does, with the store in hand
                store = dist.PrefixStore(
                    "default_pg", next(dist.rendezvous("env://", rank, world_size, timeout=timeout))[0]
                )
        self.net.choose_interface(store, os.environ)
        line = self.net.machine_line()
        if line and env.world().local_rank == 0:
            print(line, flush=True)
        with self.net.connecting():
            dist.init_process_group(
                backend=self.dist_backend(device), timeout=timeout, store=store, rank=rank, world_size=world_size
            )
        self.owns_group = True

    def dist_backend(self, device: torch.device) -> str:
        # NCCL for a process that has its own GPU, else Gloo.
        return "nccl" if device.type == "cuda" else "gloo"

    def read_world(self, device: torch.device) -> Joined:
        """Rank and world size from the joined group; the processes on this machine from the cluster environment."""
        rank, world_size = dist.get_rank(), dist.get_world_size()
        world = self.environment.world()
        return Joined(
            rank=rank,
            world_size=world_size,
            local_rank=world.local_rank,
            local_world_size=world.local_world_size if world.world_size == world_size else 1,
            device=device,
            comm=ProcessGroupCollectives(rank, world_size, device, self.run.watch, self.run.timeout_s),
        )

    def make_mesh(self) -> Mesh:
        """Under ``tensor_parallel=N`` the grid of world/N data-parallel x N tensor-parallel ranks
        (tensor-parallel innermost: one group's ranks are neighbours, on one machine where they fit)."""
        tp = self.run.tensor_parallel_size
        if tp == 1:
            return super().make_mesh()
        return grid(self.run, tp)

    def sync_batchnorm(self, model: nn.Module) -> nn.Module:
        world = self.run.world
        if world.world_size > 1 and world.device.type == "cuda":
            return nn.SyncBatchNorm.convert_sync_batchnorm(model)
        # torch's SyncBatchNorm raises on the CPU in training; the base's reduces through all_reduce.
        return super().sync_batchnorm(model)

    def shutdown(self, *, failed: bool) -> None:
        if failed and self.net is not None and self.owns_group:
            # Before the group goes: the machines that no longer answer are named.
            self.net.report_lost_peers(self.run.environment)
        if dist.is_initialized():
            if not failed:
                # The last collectives may have been synchronous ones whose
                # handles Python no longer holds (broadcast_object_list, a
                # checkpoint's agreement): a barrier through wait() keeps them
                # alive past teardown (see _RECENT_WORK).
                self.run.comm.barrier()
            if self.owns_group:
                dist.destroy_process_group()
                self.owns_group = False


def grid(run: Run, tp: int, dp_mesh: Any = None) -> Mesh:
    """The :class:`Mesh` of ``run``'s world as (world/``tp``) data-parallel x ``tp`` tensor-parallel
    ranks, rank = data_rank * tp + tp_rank.  Every rank makes every group (torch requires it)."""
    world = run.world
    check_degree(tp, world.world_size, run.name)
    dp = world.world_size // tp
    tp_group, _ = dist.new_subgroups_by_enumeration(tensor_parallel_groups(world.world_size, tp))
    dp_group, _ = dist.new_subgroups_by_enumeration([list(range(t, world.world_size, tp)) for t in range(tp)])
    data_rank, tp_rank = divmod(world.rank, tp)
    data_comm = ProcessGroupCollectives(data_rank, dp, world.device, run.watch, run.timeout_s, group=dp_group)
    return Mesh(
        data_rank=data_rank,
        data_size=dp,
        tp_rank=tp_rank,
        tp_size=tp,
        data_comm=data_comm,
        tp_group=tp_group,
        dp_group=dp_group,
        dp_mesh=dp_mesh,
    )
