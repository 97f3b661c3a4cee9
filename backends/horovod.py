"""``horovod``: Horovod's ring all-reduce (``horovod.torch``).

    horovodrun -np 2 python -m recipes.cifar10 --backend horovod

Horovod 0.28.1 must be built against the installed torch; see
``scripts/build_horovod.py``.  The optimizer is wrapped in
``hvd.DistributedOptimizer`` with plain settings, written out below so that
they are visible: gradients averaged (as DDP does), no compression, no
pre-division, and the all-reduce started at ``step`` (``synchronize()``) over
the gradients of every backward call since the last step.  Rank 0's initial
parameters (and a loaded optimizer state) are broadcast.
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import torch
from torch import nn

from parallelx.bigmodels.estimate import ModelCounts, RankMemory, Training, layout
from parallelx.errors import BackendUnavailableError, LaunchError, ParallelxError
from parallelx.launching import network
from parallelx.launching.launchers import Launcher
from parallelx.log import warn
from parallelx.parts.collectives import Collectives, Watch
from parallelx.parts.elastic import Elastic
from parallelx.parts.gradsync import GradientSync, parameter_names
from parallelx.parts.loop import LoopOptions
from parallelx.parts.precision import Precision
from parallelx.strategy import BackendSpec, Joined, Strategy
from parallelx.transforms.batchnorm import convert_batchnorm

from ._compute_copy import compute_copy
from ._moe import refuse_expert_layers

T = TypeVar("T")
#: Horovod's ``backward_passes_per_step``: more backward passes than any step takes.
NEVER = 2**62
INSTALL_HINT = "build and install it with `python scripts/build_horovod.py` (Horovod 0.28.1 patched for current torch)"

HOROVODRUN = Launcher(
    name="horovodrun",
    module="horovodrun -np {n} {opts} {python} -m {module}",
    file="horovodrun -np {n} {opts} {python} {file}",
    # Horovod's Gloo rendezvous picks its own port.
    local_opts="-H localhost:{n} --gloo --network-interface lo",
    local_env={"GLOO_SOCKET_IFNAME": "lo"},
)


def host_name_problem(environ: Mapping[str, str], host: str | None = None) -> str | None:
    """Why this machine's host name breaks a job of several machines, or None.
    Horovod 0.28.1's Gloo connects its process sets (the global one too) over
    the host name's address, whatever interface horovodrun chose
    (``HOROVOD_GLOO_IFACE``): where the name resolves to a loopback address,
    Debian's ``127.0.1.1``, the other machines dial their own loopback."""
    if int(environ.get("HOROVOD_CROSS_SIZE") or 1) <= 1:  # one host: the loopback is right
        return None
    iface = environ.get("HOROVOD_GLOO_IFACE") or ""
    table = network.interfaces()
    if table.get(iface) and all(network.is_loopback(a) for a in table[iface]):
        return None  # horovodrun's hosts are names of this machine (--network-interface lo)
    host = host or socket.gethostname()
    try:
        address: str | None = network.resolve(host)
    except network.NetworkError:
        address = None
    if address is not None and not network.is_loopback(address):
        return None
    mine = [a for a in table.get(iface, []) if ":" not in a]
    line = f"{mine[0] if mine else '<its address>'} {host}"
    return (
        f"horovod: this machine's host name {host} resolves to {address or 'nothing'} here, and Horovod's Gloo "
        f"connects its process sets over the host name's address whatever the interface (HOROVOD_GLOO_IFACE="
        f"{iface or 'unset'}): the other machines would dial {address or 'nothing'}; map {host} to the address "
        f"the other machines reach in /etc/hosts on this machine (the line `{line}`)"
    )


def _driver_elsewhere(environ: Mapping[str, str]) -> bool:
    """Whether horovodrun runs on another machine than this rank (its rendezvous is not here)."""
    addr = environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
    if not addr:
        return False
    try:
        address = network.resolve(addr)
    except network.NetworkError:
        return False
    own = {a for addrs in network.interfaces().values() for a in addrs}
    return not network.is_loopback(address) and address not in own


class HorovodStrategy(Strategy):
    spec = BackendSpec(
        name="horovod",
        summary="`hvd.DistributedOptimizer` (averaging, no compression), rank-0 broadcast",
        launcher=HOROVODRUN,
        requires_module="horovod",
        # Seen with 0.28.1 on the Gloo controller: a rank that never joins a
        # collective is not shut down by Horovod's stall inspector.
        needs_watchdog=True,
        install_hint=INSTALL_HINT,
        probe_code=(
            "import horovod, horovod.torch as h; print('horovod', horovod.__version__, "
            "'gloo' if h.gloo_built() else '', 'nccl' if h.nccl_built() else '')"
        ),
        # hvd.init() forms the world from horovodrun's variables; without them, a world of one.
        # Not srun's tasks (this build has no MPI: horovodrun with the allocation's hosts) nor Ray (which dropped Horovod).
        environments=("horovodrun", "local"),
    )

    def __init__(self) -> None:
        self.wrapped: list[nn.Module] = []

    @classmethod
    def estimate_memory(cls, model: ModelCounts, world_size: int, training: Training) -> list[RankMemory]:
        # Gradients are all-reduced in place, several at once through a fusion buffer of up to 128 MiB
        # (HOROVOD_FUSION_THRESHOLD's default); rank 0's weights are broadcast tensor by tensor.
        fusion = min(model.trainable_bytes, 128 * 2**20)
        return [layout(cls.spec.name, model, world_size, training, extra=fusion, why="fusion buffer")]

    def join(self) -> Joined:
        # Horovod reads its timeouts from the environment: the Gloo rendezvous
        # timeout, and the stall inspector, which by default only warns about a
        # rank that never joins a collective; make it shut the job down instead.
        # An explicit parallelx timeout overrides values already set.  Seen
        # with 0.28.1 on the Gloo controller: a rank that never joins (asleep)
        # is not shut down by the stall inspector, hence needs_watchdog; a rank
        # that *exits* is handled by horovodrun, which then stops every other rank.
        timeout = max(1, int(self.run.timeout_s))
        for key, value in (
            ("HOROVOD_GLOO_TIMEOUT_SECONDS", timeout),
            ("HOROVOD_STALL_CHECK_TIME_SECONDS", min(60, timeout)),
            ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", timeout),
        ):
            if self.run.timeout_explicit or os.environ.get(key, "0") in ("", "0"):
                os.environ[key] = str(value)
        env = self.run.environment
        assert env is not None, "the facade detects the environment before join()"
        launched = env.name == "horovodrun"
        try:
            import horovod.torch as hvd
        except ImportError as exc:
            raise BackendUnavailableError(
                f"horovod is installed but horovod.torch does not load ({exc}); "
                f"it was probably built for another torch: {INSTALL_HINT}"
            ) from None
        self.hvd = hvd
        problem = host_name_problem(os.environ) if launched else None
        if problem and _driver_elsewhere(os.environ):  # surely another machine
            raise LaunchError(problem)
        if problem:  # the hosts may all be names of this machine, where the loopback works
            warn(f"if this job's hosts are other machines, it fails at start-up: {problem}")
        hvd.init()
        if not launched:
            warn(
                f"horovod: no launcher found, running as a world of 1 process; for N processes start with "
                f"`{self.spec.launcher.usage()}`"
            )
        # Horovod moves CUDA tensors with NCCL only when it was built with it.
        if self.run.device_request == "cuda" and not hvd.nccl_built():
            raise ParallelxError(
                "horovod: device 'cuda' asked for, but this Horovod was built without NCCL; "
                f"rebuild it on the GPU machine ({INSTALL_HINT}) or use --device cpu"
            )
        return self.world()

    def world(self) -> Joined:
        """Where this process stands in Horovod's world (again after an elastic reset)."""
        hvd = self.hvd
        # Horovod moves CUDA tensors with NCCL only when it was built with it.
        device = self.run.pick_device(hvd.local_rank()) if hvd.nccl_built() else torch.device("cpu")
        return Joined(
            rank=hvd.rank(),
            world_size=hvd.size(),
            local_rank=hvd.local_rank(),
            local_world_size=hvd.local_size(),
            device=device,
            comm=HorovodCollectives(hvd, device, self.run.watch),
        )

    def gradient_sync(self) -> GradientSync:
        return HorovodSync(self.run.models)

    def elastic(self) -> Elastic:
        return HorovodElastic(self.hvd, self.rejoined, self.run.watch)

    def shutdown(self, *, failed: bool) -> None:
        # After a failure horovodrun stops the other ranks; a shutdown here could wait for them.
        if not failed:
            self.hvd.shutdown()

    def wrap_model(self, model: nn.Module) -> nn.Module:
        refuse_expert_layers(model, self.name)
        model = model.to(self.run.device)
        self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        # bf16-compute: a bfloat16 copy for the forward and backward; the float32 gradients are all-reduced.
        compute_copy(model, lambda: self.run.options.compute_dtype, self.name, self.run.activation_checkpointing)
        self.wrapped.append(model)
        return model

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        hvd = self.hvd
        # Horovod matches gradients across ranks by these names (Backend.wrap_optimizer
        # has checked that every parameter belongs to a wrapped model).
        names = parameter_names(self.wrapped)
        named = [(names[id(p)], p) for group in optimizer.param_groups for p in group["params"]]
        compression = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}[self.run.options.grad_compression]
        # backward_passes_per_step: never reached, so that no all-reduce fires in
        # a backward; synchronize() in step() all-reduces the summed gradients.
        # A window's backward count is not known ahead (several backward calls
        # per micro-batch, a loss through another model's parameters), and a
        # gradient added after its all-reduce has started would be lost or
        # trip Horovod's own assertion ("Gradients were computed more than
        # backward_passes_per_step times").  The cost: the all-reduce no longer
        # overlaps the backward.
        dist_opt = hvd.DistributedOptimizer(
            optimizer,
            named_parameters=named,
            op=hvd.Average,
            compression=compression,
            backward_passes_per_step=NEVER,
            gradient_predivide_factor=1.0,
        )
        # Horovod's zero_grad() refuses to run between a backward and step()
        # (an all-reduce might be in flight); here none ever is, so zeroing
        # gradients that a loss put there (another model's, through this one)
        # only forgets Horovod's count of backward passes, as step() does.
        dist_opt.zero_grad = functools.partial(_zero_grad, dist_opt)
        # hvd.broadcast_optimizer_state initialises an empty state with a
        # zero-gradient step, which weight decay turns into a real update.  A
        # fresh optimizer is empty (hence equal) on every rank, so only a
        # loaded state needs broadcasting; all ranks agree on that first.
        has_state = torch.tensor([1 if optimizer.state_dict()["state"] else 0])
        agree = self.run.comm.all_reduce(has_state, op="sum").item()
        if agree not in (0, self.run.world.world_size):
            raise ParallelxError(
                "horovod: optimizer state was loaded on some ranks but not others; load the checkpoint on every rank"
            )
        if agree:
            hvd.broadcast_optimizer_state(dist_opt, root_rank=0)
        return dist_opt

    def configure(self, options: LoopOptions) -> LoopOptions:
        if options.grad_compression == "bf16":
            raise ParallelxError(
                "horovod: --grad-compression bf16 is not available: Horovod has no bfloat16 "
                "tensor support; use fp16 (hvd.Compression.fp16) or none"
            )
        return options

    def sync_batchnorm(self, model: nn.Module) -> nn.Module:
        if self.run.world.world_size > 1 and self.run.device.type == "cuda":
            return convert_batchnorm(model, self.hvd.SyncBatchNorm)
        # hvd.SyncBatchNorm runs on GPUs only; the base's reduces through all_reduce.
        return super().sync_batchnorm(model)

    def rejoined(self) -> None:
        """Take the new world's rank and sizes after ``hvd.elastic.run`` re-initialised
        Horovod (ranks are not stable across a reset; the world may have shrunk)."""
        self.run.rejoin(self.world())
        # The models of an earlier train() are gone: their parameter names must
        # not prefix the new ones (Horovod matches gradients across ranks by name).
        self.wrapped = []


def _zero_grad(dist_opt: Any, set_to_none: bool = True) -> None:
    """``hvd.DistributedOptimizer.zero_grad`` where no all-reduce runs between the steps: clear
    Horovod's record of backward passes (no handle is pending), then zero as ``torch.optim`` does."""
    handles = dist_opt._handles
    if any(handle is not None for handle, _ in handles.values()):
        dist_opt.synchronize()  # not reached: backward_passes_per_step=NEVER fires none in a backward
    for p in list(handles):
        dist_opt._allreduce_delay[p] = dist_opt.backward_passes_per_step
    handles.clear()
    super(type(dist_opt), dist_opt).zero_grad(set_to_none=set_to_none)  # the user's optimizer's own


class HorovodCollectives(Collectives):
    """Horovod's collectives (Gloo or MPI controller; NCCL for CUDA tensors where built with it)."""

    def __init__(self, hvd: Any, device: torch.device, watch: Watch) -> None:
        super().__init__(hvd.rank(), hvd.size(), watch)
        self.hvd = hvd
        self.device = device

    def comm_device(self, tensor: torch.Tensor) -> torch.device:
        return self.device

    def reduce_(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        hvd = self.hvd
        return hvd.allreduce(tensor, op={"sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min}[op])

    def barrier(self) -> None:
        with self.watch("barrier"):
            self.hvd.barrier()

    def broadcast(self, obj: T, src: int = 0) -> T:
        with self.watch("broadcast"):
            if isinstance(obj, torch.Tensor):
                return cast(T, self.hvd.broadcast(obj.to(self.device), root_rank=src).to(obj.device))
            return cast(T, self.hvd.broadcast_object(obj, root_rank=src))

    def all_gather_list(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        # hvd.allgather takes a different first dimension on each rank; the sizes split its result.
        with self.watch("all_gather"):
            sizes = self.hvd.allgather(torch.tensor([tensor.shape[0]], device=tensor.device)).tolist()
            return list(torch.split(self.hvd.allgather(tensor), sizes))


class HorovodSync(GradientSync):
    """``hvd.DistributedOptimizer`` all-reduces the summed gradients of its
    parameters in ``synchronize()``, at ``step``: after every backward call
    of the window, whichever models each one reached."""

    def synchronize(self, optimizer: torch.optim.Optimizer) -> None:
        # Start the all-reduces of this optimizer's parameters and wait for them,
        # so that clipping sees the averaged gradients.
        cast(Any, optimizer).synchronize()  # hvd.DistributedOptimizer's

    def apply(self, optimizer: torch.optim.Optimizer, precision: Precision) -> bool:
        with cast(Any, optimizer).skip_synchronize():  # already averaged above
            return super().apply(optimizer, precision)


class HorovodElastic(Elastic):
    """Horovod's elastic runs: ``train()`` again in the new world after hosts join or leave."""

    def __init__(self, hvd: Any, rejoined: Callable[[], None], watch: Watch) -> None:
        self.hvd = hvd
        self.rejoined = rejoined
        self.watch = watch
        self.state: Any = None

    def run(self, train: Callable[[], T]) -> T:
        # horovodrun sets HOROVOD_ELASTIC=1 only when started elastic (--min-np,
        # --max-np or --host-discovery-script); a fixed world has nothing to rejoin.
        if os.environ.get("HOROVOD_ELASTIC") != "1":
            return train()
        from horovod.common.elastic import ObjectState

        hvd = self.hvd
        # The state is the training-state checkpoint on disk, which train()
        # reloads each time: survivors and new ranks then start from the same
        # files, and a fresh job started over resumes from them too.  What
        # Horovod keeps in memory is only the number of commits (rolled back to
        # the last one, broadcast from rank 0 to ranks that join).
        state = ObjectState(hvd.broadcast_object, hvd.rank, commits=0)

        def attempt(state: ObjectState) -> T:
            self.rejoined()
            return train()

        self.state = state
        try:
            return cast(T, hvd.elastic.run(attempt)(state))
        finally:
            self.state = None

    def commit(self) -> None:
        if self.state is not None:
            with self.watch("elastic commit"):
                self.state.commits += 1
                self.state.commit()  # raises HostsUpdatedInterrupt, which run() handles, when hosts changed
