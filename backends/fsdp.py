"""``fsdp``: PyTorch's own sharding, FSDP2 (``torch.distributed.fsdp.fully_shard``).

    torchrun --nproc-per-node 2 -m recipes.cifar10 --backend fsdp
    torchrun --nproc-per-node 2 -m recipes.dogcat --backend fsdp --fsdp-shard Linear,Conv2d --fsdp-sharded-checkpoints

Each rank holds a dim-0 slice of every parameter, of its gradient and of its
optimizer state; a sharded module's parameters are gathered whole for its
forward and backward only.  Gradients are reduce-scattered and averaged (the
plain mean), so the update is that of one process on the global batch, as on
every backend.  NCCL on GPUs, Gloo on the CPU, always on an explicit device
mesh of the whole world (without one FSDP2 builds it on the accelerator, which
breaks a Gloo group on a GPU machine).  ``--backend auto`` never picks it:
sharding is chosen.

Which modules are sharded (``shard=``): by default each block holding a large
share of the parameters (:func:`parallelx.transforms.units.default_units`: never a
container without ``forward``, never a module whose weight is tied outside
it), then the root, which takes the rest; or a callable ``module -> bool``,
or module classes, as types or by name (``--fsdp-shard Block`` or
``--fsdp-shard Linear,Conv2d`` on the command line).  The loop's options map
onto FSDP2 as: accumulation -> ``set_requires_gradient_sync(False)`` inside a
window; clipping -> the global norm taken as one process takes it
(``_fsdp_state.grad_norm``); ``16-mixed`` -> torch's ``ShardedGradScaler``,
whose skip decision all ranks share; ``bf16-mixed`` -> autocast over float32 FSDP2
(FSDP2's own ``MixedPrecisionPolicy`` casts the weights, which changes the
numbers); ``bf16-compute`` -> ``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32, output_dtype=float32)`` (torchtitan's default: the gathers,
forward and backward in bfloat16, the float32 shards stepped and their gradients
reduced in float32); ``--grad-compression`` -> ``MixedPrecisionPolicy(reduce_dtype=...)``.

Hybrid sharding (HSDP, ``replicate=R`` or ``--fsdp-replicate R``): a 2-D mesh of R
groups that each hold a whole copy of the model, sharded over their N/R ranks; a
gradient is reduce-scattered within a group and all-reduced across the groups, so
the update is still that of one process.  By default, across machines when there are
several (R = the number of machines, each machine's processes one group: the all-gathers
of every forward stay on the machine) and none on one machine.  ``replicate=1`` shards
over every rank wherever they run.

Checkpoints are portable (whole tensors, plain names, on the CPU) like every
backend's; with ``sharded_checkpoints=True`` (``--fsdp-sharded-checkpoints``)
the training-state checkpoints hold each rank's shards instead, written with
torch.distributed.checkpoint (see :mod:`parallelx.checkpoints.sharded`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from parallelx import log
from parallelx.bigmodels.estimate import ModelCounts, RankMemory, Training, layout
from parallelx.bigmodels.export import Layout
from parallelx.bigmodels.meta import Values, has_meta
from parallelx.errors import ParallelxError
from parallelx.parts.collectives import Collectives
from parallelx.parts.gradsync import (
    GradientSync,
    Models,
    model_order,
    optimizer_params,
    owner_names,
    summed_per_parameter,
)
from parallelx.parts.lockstep import ForwardLockstep
from parallelx.parts.loop import LoopOptions
from parallelx.parts.mesh import Mesh, check_degree
from parallelx.parts.precision import Precision
from parallelx.parts.shards import ParameterShards
from parallelx.parts.state import named_from_indexed
from parallelx.parts.stateio import StateIO, Unwrap
from parallelx.storage import Location
from parallelx.strategies.process_group import ProcessGroupStrategy, grid
from parallelx.strategy import BackendSpec, Joined, unwrap
from parallelx.transforms.compiling import compile_in_place
from parallelx.transforms.units import UnitPolicy, parse_names, select_units
from parallelx.utils import lazy_module

from ._allocator import after_first_step, return_freed_memory
from ._moe import refuse_expert_layers
from ._shards import DTensorShards
from .ddp import TORCHRUN

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

# FSDP2, DTensor and torch.distributed.checkpoint load when an fsdp backend starts (about a second of
# start-up), not in every process that reads the backends' options.
fsdp_state = lazy_module(f"{__package__}._fsdp_state")

#: What ``shard=`` accepts (see :mod:`parallelx.transforms.units`).
ShardPolicy = UnitPolicy


class ShardedPrecision(Precision):
    """Under ``16-mixed`` each rank checks only its slices for inf/nan:
    torch's ``ShardedGradScaler`` all-reduces that finding, so that every rank
    skips the same steps."""

    def _make_scaler(self) -> torch.amp.GradScaler | None:
        if self.name != "16-mixed":
            return None
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(self.device.type)


class FSDPSync(GradientSync):
    """FSDP2 reduce-scatters in its backward hooks; inside a window it keeps whole local gradients."""

    def __init__(self, models: Models, comm: Collectives, sharded: list[FSDPModule], replicas: int = 1) -> None:
        super().__init__(models)
        self.comm = comm
        self.sharded = sharded
        #: HSDP's groups: each holds every shard, so a sum over the world counts a shard this often.
        self.replicas = replicas
        #: False inside a window: gradients stay local.
        self.syncing = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        # Gradients stay whole and local inside a window; the last micro-batch reduce-scatters their sum.
        for m in self.sharded:
            m.set_requires_gradient_sync(False)
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True
            for m in self.sharded:
                m.set_requires_gradient_sync(True)

    def average_replicated(self, param: torch.Tensor) -> None:
        """A gradient hook for a parameter FSDP2 keeps whole on every rank (a
        scalar): averaged over the ranks in the backward, as DDP does, outside
        a window's no-sync."""
        if self.syncing and param.grad is not None and self.comm.world_size > 1:
            param.grad.copy_(self.comm.all_reduce(param.grad, "mean"))

    def clip(self, optimizer: torch.optim.Optimizer, max_norm: float | None) -> torch.Tensor | None:
        # When it clips the norm scales the update: each parameter's whole gradient norm, as torch's to the bit.
        params = model_order(optimizer_params(optimizer), self.models())
        tp = self.tensor_parallel
        # Under tensor parallelism a split gradient's slices are counted once over the world, a whole
        # one's once per tensor-parallel rank too; the exact per-parameter norms would gather each whole.
        copies = self.replicas if tp is None else [self.replicas * (1 if tp.is_split(p) else tp.size) for p in params]
        norm = fsdp_state.grad_norm(
            params,
            exact=max_norm is not None and tp is None,
            all_reduce=lambda t: summed_per_parameter(self.comm, t),
            replicas=copies,
        )
        if max_norm is not None:
            fsdp_state.clip_(params, max_norm, norm)
        return norm

    def averaged_gradients(self, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        names = owner_names(optimizer_params(optimizer), self.models())
        return self.named_whole(
            [
                (names.get(id(p), f"param{i}"), p, fsdp_state.full(p.grad).float())
                for i, p in enumerate(optimizer_params(optimizer))
                if p.grad is not None
            ]
        )


class FSDPStateIO(StateIO):
    """Whole state put together from the shards, and cut back into them
    (``torch.distributed.checkpoint.state_dict``), or the shards as they are
    for sharded checkpoints."""

    def __init__(self, unwrap: Unwrap, models: Models, sharded_checkpoints: bool) -> None:
        super().__init__(unwrap)
        self.models = models
        self.sharded_checkpoints = sharded_checkpoints

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return fsdp_state.model_state(self.unwrap(model))

    def load_model_state_dict(self, model: nn.Module, state: Any) -> None:
        fsdp_state.load_model_state(self.unwrap(model), state)

    def optimizer_state_dict(self, optimizer: Any) -> dict[str, Any] | None:
        return fsdp_state.full(optimizer.state_dict())

    def load_optimizer_state_dict(self, optimizer: Any, state: Any) -> None:
        # A plain torch.optim state (positions, in group order), as optimizer_state_dict gives.
        module = self._owner(optimizer)
        names = fsdp_state.param_names(module)
        groups = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        fsdp_state.load_named_state(module, optimizer, named_from_indexed(state, groups))

    def named_optimizer_state(self, model: nn.Module, optimizer: Any) -> dict[str, Any]:
        return fsdp_state.named_state(self.unwrap(model), optimizer, whole=True)

    def load_named_optimizer_state(self, model: nn.Module, optimizer: Any, state: Any) -> None:
        fsdp_state.load_named_state(self.unwrap(model), optimizer, state)

    def sharded_state(self, model: nn.Module, optimizer: Any) -> dict[str, Any] | None:
        return fsdp_state.sharded_state(self.unwrap(model), optimizer) if self.sharded_checkpoints else None

    def copy_shards(self, shards: Any, copy: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        return fsdp_state.copy_shards(shards, copy)

    def load_sharded_state(
        self, model: nn.Module, optimizer: Any, directory: Location, saved: Mapping[str, Any]
    ) -> bool:
        fsdp_state.load_sharded_state(self.unwrap(model), optimizer, directory, saved["param_groups"])
        return True

    def _owner(self, optimizer: Any) -> nn.Module:
        wanted = {id(p) for p in optimizer_params(optimizer)}
        for module in self.models():
            if wanted & {id(p) for p in module.parameters()}:
                return module
        raise ParallelxError("fsdp: this optimizer trains no model set up by this backend")


class FSDPStrategy(ProcessGroupStrategy):
    spec = BackendSpec(
        name="fsdp",
        summary="`fully_shard` (FSDP2): parameters, gradients and optimizer state sharded; NCCL on GPUs, Gloo on the CPU",
        launcher=TORCHRUN,
        tensor_parallel=True,
        probe_code=(
            "import torch, torch.distributed.fsdp as f; print('torch', torch.__version__, "
            "'fully_shard' if hasattr(f, 'fully_shard') else 'no fully_shard')"
        ),
        offloads=True,
        # Every environment that gives a torch.distributed rendezvous, and none (a world of one).
        environments=("ray", "torchrun", "deepspeed", "slurm", "env", "local"),
    )
    precision_class = ShardedPrecision

    def __init__(
        self,
        *,
        shard: ShardPolicy = None,
        reshard_after_forward: bool = True,
        sharded_checkpoints: bool = False,
        replicate: int | None = None,
    ) -> None:
        if shard is not None and not callable(shard):
            shard = tuple(shard)
            if not all(isinstance(t, str) or (isinstance(t, type) and issubclass(t, nn.Module)) for t in shard):
                raise ParallelxError(f"fsdp: shard= takes a callable, module types or class names, got {shard!r}")
        self.shard = shard
        self.reshard_after_forward = bool(reshard_after_forward)
        self.sharded_checkpoints = bool(sharded_checkpoints)
        if replicate is not None and (isinstance(replicate, bool) or not isinstance(replicate, int) or replicate < 1):
            raise ParallelxError(f"fsdp: replicate= takes a whole number of groups, 1 or more, got {replicate!r}")
        #: HSDP's replica groups asked for (None: one per machine when there are several).
        self.replicate = replicate
        self.replicas = 1
        self.sharded: list[FSDPModule] = []
        self.renamed: dict[int, tuple[nn.Module, str]] = {}
        self.lockstep: ForwardLockstep | None = None

    @classmethod
    def estimate_memory(cls, model: ModelCounts, world_size: int, training: Training) -> list[RankMemory]:
        # Parameters, gradients and optimizer state are each split in dim-0 slices over the ranks; a
        # step gathers one unit whole at a time (and prefetches the next), the root's share for the
        # whole forward and backward.
        return [layout(cls.spec.name, model, world_size, training, shards=("params", "grads", "optimizer"))]

    def configure(self, options: LoopOptions) -> LoopOptions:
        if self.sharded and options.compute_dtype != self.run.options.compute_dtype:
            # The gathers' type is FSDP2's policy, fixed when a model is sharded.
            raise ParallelxError(
                f"fsdp: precision {options.precision} after a model was set up under {self.run.options.precision}: "
                "FSDP2 fixes the type of its gathers when it shards a model; choose bf16-compute (or not) before "
                "backend.setup(), in the Backend's options"
            )
        return super().configure(options)

    def state_io(self) -> StateIO:
        return FSDPStateIO(unwrap, self.run.models, self.sharded_checkpoints)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("fsdp")
        group.add_argument(
            "--fsdp-shard",
            default=None,
            metavar="CLASSES",
            help="modules sharded as units before the root: auto (the blocks holding 10%% or more of the "
            "parameters; never a container without forward or a weight tied outside it) or class names of "
            "the model's modules, e.g. Block or Linear,Conv2d (default: auto)%(default).0s",
        )
        group.add_argument(
            "--fsdp-no-reshard-after-forward",
            action="store_true",
            help="keep each unit's gathered parameters from the forward to the backward "
            "(more memory, one all-gather less)",
        )
        group.add_argument(
            "--fsdp-replicate",
            type=int,
            default=None,
            metavar="R",
            help="hybrid sharding (HSDP): R groups, each holding a whole copy of the model sharded over its "
            "processes (default: one group per machine when there are several; 1 shards over every rank)%(default).0s",
        )
        group.add_argument(
            "--fsdp-sharded-checkpoints",
            action="store_true",
            help="training-state checkpoints hold each rank's shards (torch.distributed.checkpoint); "
            "python -m parallelx convert-checkpoint makes a portable file of one",
        )

    @classmethod
    def options_from_args(cls, args: argparse.Namespace) -> dict[str, Any]:
        options = super().options_from_args(args)
        options.update(
            shard=parse_names(getattr(args, "fsdp_shard", None)),
            reshard_after_forward=not getattr(args, "fsdp_no_reshard_after_forward", False),
            sharded_checkpoints=getattr(args, "fsdp_sharded_checkpoints", False),
            replicate=getattr(args, "fsdp_replicate", None),
        )
        return options

    def join(self) -> Joined:
        from torch.distributed.device_mesh import init_device_mesh

        device = self.join_rendezvous()
        joined = self.read_world(device)
        return_freed_memory(device)  # the gathered units' blocks, freed every step (_allocator)
        # Explicit, on this process's device type: never FSDP2's accelerator default.
        # Under --tensor-parallel N FSDP2 shards over the data-parallel ranks only (2D; with HSDP, 3D), the
        # tensor-parallel dimension innermost (parallelx.parts.mesh).
        tp = self.run.tensor_parallel_size
        check_degree(tp, joined.world_size, self.name)
        dp = joined.world_size // tp
        self.replicas = replicas = self.replica_groups(joined, dp, tp)
        if replicas > 1:  # HSDP: FSDP2 reads a 2-D mesh as (replicate, shard)
            dims, names = (replicas, dp // replicas), ("replicate", "shard")
            full = init_device_mesh(
                device.type, (*dims, tp) if tp > 1 else dims, mesh_dim_names=(*names, "tp") if tp > 1 else names
            )
            self.mesh = full["replicate", "shard"] if tp > 1 else full
            if joined.rank == 0:  # the default across machines is chosen silently otherwise
                log.info(
                    f"fsdp: hybrid sharding, {replicas} groups of {dp // replicas} processes "
                    "(each group a whole copy of the model, sharded within it)"
                )
        elif tp > 1:
            self.mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("shard", "tp"))["shard"]
        else:
            self.mesh = init_device_mesh(device.type, (joined.world_size,))
        self.sync = FSDPSync(self.run.models, joined.comm, self.sharded, replicas)
        return joined

    def make_mesh(self) -> Mesh:
        tp = self.run.tensor_parallel_size
        return super().make_mesh() if tp == 1 else grid(self.run, tp, dp_mesh=self.mesh)

    def replica_groups(self, joined: Joined, dp: int | None = None, tp: int = 1) -> int:
        """How many whole copies of the model HSDP keeps over the ``dp`` data-parallel ranks (1: plain
        sharding over all of them)."""
        n, per_machine = (
            joined.world_size if dp is None else dp,
            max(1, joined.local_world_size // tp if joined.local_world_size % tp == 0 else 1),
        )
        if self.replicate is None:  # across machines when there are several, each machine a group
            machines = n // per_machine if n % per_machine == 0 else 1
            return machines if 1 < machines < n else 1
        if self.replicate < 1 or n % self.replicate:
            what = f"the world of {n} processes" if tp == 1 else f"the {n} data-parallel ranks (--tensor-parallel {tp})"
            raise ParallelxError(
                f"fsdp: --fsdp-replicate {self.replicate} does not divide {what} into "
                f"groups of the same size: give a divisor of {n} (1 shards over every rank)"
            )
        return self.replicate

    def gradient_sync(self) -> GradientSync:
        return self.sync

    # ------------------------------------------------------------ wrapping
    def units(self, model: nn.Module) -> list[nn.Module]:
        """The modules sharded as units of their own before the root, innermost first."""
        return select_units(model, self.shard, who="fsdp")

    def wrap_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            FSDPModule,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        if isinstance(model, FSDPModule):
            raise ParallelxError("fsdp: this model is already sharded")
        refuse_expert_layers(model, self.name)
        # Built under parallelx.init_module(): sharded on the meta device, then each tensor computed
        # whole, one at a time, and only this rank's slice kept (every rank computes the same values).
        meta = Values(model, "fsdp") if has_meta(model) else None
        if meta is None:
            model = model.to(self.run.device)
        units = self.units(model)  # before any change: a wrong choice fails before the broadcasts
        # Rank 0's parameters and buffers on every rank, as DDP does at construction.
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()] if meta is None else []:
                self.broadcast_into(t)
        # The optimizer was built on the parameters fully_shard replaces: remember their names.
        self.renamed.update({id(p): (model, n) for n, p in model.named_parameters()})
        # The wire type is built in here: set_options(grad_compression=...) applies to models wrapped later.
        # bf16-compute: FSDP2 gathers a bfloat16 copy of each unit; its gradients are cast back to float32
        # before the reduce-scatter (unless --grad-compression asks otherwise) and the loss sees float32.
        compute = self.run.options.compute_dtype
        policy = MixedPrecisionPolicy(
            param_dtype=compute,
            reduce_dtype=self.run.options.wire_dtype or (torch.float32 if compute is not None else None),
        )  # None: the gradients' dtype
        # Only the root's outputs are cast back: a unit's float32 output would meet the next unit's bfloat16.
        root_policy = dataclasses.replace(policy, output_dtype=torch.float32 if compute is not None else None)
        # fully_shard cannot split a scalar (CLIP's logit_scale): such parameters stay whole on every
        # rank, and their gradients are averaged by a hook of parallelx's, in the backward, as DDP would.
        scalars = {p for p in model.parameters() if p.dim() == 0}
        for module in [*units, model]:
            if module is not model and self.run.compile_options.enabled:  # per block, between FSDP2's collectives
                compile_in_place(module, self.run.compile_options)
            sharded = fully_shard(
                module,
                mesh=self.mesh,
                # None is FSDP2's default: True for the units, False for the root, whose parameters the
                # backward needs at once (an explicit True re-gathers the root in every backward).
                reshard_after_forward=None if self.reshard_after_forward else False,
                mp_policy=root_policy if module is model else policy,
                offload_policy=CPUOffloadPolicy() if self.run.cpu_offload else OffloadPolicy(),
                ignored_params=scalars or None,
            )
        if meta is not None:
            fsdp_state.materialize_shards(model, meta, self.run.device)  # new objects for the scalars
        for p in model.parameters():
            if p.dim() == 0 and p.requires_grad:
                p.register_post_accumulate_grad_hook(self.sync.average_replicated)
        if self.run.world.world_size > 1:
            if self.lockstep is None:
                self.lockstep = ForwardLockstep("fsdp", self.run.world.rank, self.run.timeout_s)
            lockstep = self.lockstep
            # Before FSDP2's own pre-forward (its gathers): a rank-0-only forward is one clear error, not a hang.
            lockstep.guard(model)
        self.sharded.append(sharded)
        return model

    def compile(self, wrapped: nn.Module) -> None:
        pass  # the units were compiled one by one before sharding (wrap_model)

    def materialize(self, model: nn.Module) -> None:
        pass  # sharded first, then each rank computes its slices (wrap_model)

    def weight_pieces(self, model: nn.Module) -> Layout:
        return fsdp_state.weight_pieces(unwrap(model), self.run.world.rank)  # HSDP: the first group writes

    def parameter_shards(self, model: nn.Module) -> ParameterShards:
        return DTensorShards(unwrap(model))

    def broadcast_into(self, tensor: torch.Tensor) -> None:
        mesh = self.run.mesh
        if mesh is not None and mesh.tensor_parallel:  # within the data-parallel group: each holds its slices
            if mesh.data_size > 1:
                buf = tensor.detach().to(self.run.comm.comm_device(tensor))
                dist.broadcast(buf, src=dist.get_global_rank(mesh.dp_group, 0), group=mesh.dp_group)
                tensor.copy_(buf)
        elif self.run.world.world_size > 1:
            buf = tensor.detach().to(self.run.comm.comm_device(tensor))
            dist.broadcast(buf, src=0)
            tensor.copy_(buf)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        # Point the user's optimizer at the sharded parameters, by name.
        swapped: dict[int, nn.Parameter] = {}
        for group in optimizer.param_groups:
            new = []
            for p in group["params"]:
                if id(p) in self.renamed:
                    model, name = self.renamed.pop(id(p))
                    swapped[id(p)] = model.get_parameter(name)
                    new.append(swapped[id(p)])
                else:  # built on the sharded model already
                    new.append(p)
            group["params"] = new
        for old_id, p in swapped.items():
            old = next((q for q in optimizer.state if id(q) == old_id), None)
            if old is not None:  # state made before set-up: now whole tensors for sharded parameters
                optimizer.state[p] = {
                    k: fsdp_state.like(v, p) if torch.is_tensor(v) and v.dim() else v
                    for k, v in optimizer.state.pop(old).items()
                }
        after_first_step(optimizer)  # the allocator's steady threshold (_allocator)
        return optimizer
