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
numbers); ``--grad-compression`` -> ``MixedPrecisionPolicy(reduce_dtype=...)``.

Checkpoints are portable (whole tensors, plain names, on the CPU) like every
backend's; with ``sharded_checkpoints=True`` (``--fsdp-sharded-checkpoints``)
the training-state checkpoints hold each rank's shards instead, written with
torch.distributed.checkpoint (see :mod:`parallelx.checkpoints.sharded`).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from parallelx.errors import ParallelxError
from parallelx.parts.collectives import Collectives
from parallelx.parts.gradsync import GradientSync, Models, model_order, optimizer_params, owner_names
from parallelx.parts.lockstep import ForwardLockstep
from parallelx.parts.precision import Precision
from parallelx.parts.state import named_from_indexed
from parallelx.parts.stateio import StateIO, Unwrap
from parallelx.strategies.process_group import ProcessGroupStrategy
from parallelx.strategy import BackendSpec, Joined, unwrap
from parallelx.transforms.compiling import compile_in_place
from parallelx.transforms.units import UnitPolicy, parse_names, select_units
from parallelx.utils import lazy_module

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

    def __init__(self, models: Models, comm: Collectives, sharded: list[FSDPModule]) -> None:
        super().__init__(models)
        self.comm = comm
        self.sharded = sharded
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
        norm = fsdp_state.grad_norm(
            params, exact=max_norm is not None, all_reduce=lambda t: self.comm.all_reduce(t, "sum")
        )
        if max_norm is not None:
            fsdp_state.clip_(params, max_norm, norm)
        return norm

    def averaged_gradients(self, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        names = owner_names(optimizer_params(optimizer), self.models())
        return {
            names.get(id(p), f"param{i}"): fsdp_state.full(p.grad).float()
            for i, p in enumerate(optimizer_params(optimizer))
            if p.grad is not None
        }


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

    def load_sharded_state(
        self, model: nn.Module, optimizer: Any, directory: Path, param_groups: list[dict[str, Any]]
    ) -> bool:
        fsdp_state.load_sharded_state(self.unwrap(model), optimizer, directory, param_groups)
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
    ) -> None:
        if shard is not None and not callable(shard):
            shard = tuple(shard)
            if not all(isinstance(t, str) or (isinstance(t, type) and issubclass(t, nn.Module)) for t in shard):
                raise ParallelxError(f"fsdp: shard= takes a callable, module types or class names, got {shard!r}")
        self.shard = shard
        self.reshard_after_forward = bool(reshard_after_forward)
        self.sharded_checkpoints = bool(sharded_checkpoints)
        self.sharded: list[FSDPModule] = []
        self.renamed: dict[int, tuple[nn.Module, str]] = {}
        self.lockstep: ForwardLockstep | None = None

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
        )
        return options

    def join(self) -> Joined:
        from torch.distributed.device_mesh import init_device_mesh

        device = self.join_rendezvous()
        joined = self.read_world(device)
        # Explicit, on this process's device type: never FSDP2's accelerator default.
        self.mesh = init_device_mesh(device.type, (joined.world_size,))
        self.sync = FSDPSync(self.run.models, joined.comm, self.sharded)
        return joined

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
        model = model.to(self.run.device)
        units = self.units(model)  # before any change: a wrong choice fails before the broadcasts
        # Rank 0's parameters and buffers on every rank, as DDP does at construction.
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                self.broadcast_into(t)
        # The optimizer was built on the parameters fully_shard replaces: remember their names.
        self.renamed.update({id(p): (model, n) for n, p in model.named_parameters()})
        # The wire type is built in here: set_options(grad_compression=...) applies to models wrapped later.
        policy = MixedPrecisionPolicy(reduce_dtype=self.run.options.wire_dtype)  # None: the gradients' dtype
        # fully_shard cannot split a scalar (CLIP's logit_scale): such parameters stay whole on every
        # rank, and their gradients are averaged by a hook of parallelx's, in the backward, as DDP would.
        scalars = {p for p in model.parameters() if p.dim() == 0}
        for p in scalars:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self.sync.average_replicated)
        for module in [*units, model]:
            if module is not model and self.run.compile_options.enabled:  # per block, between FSDP2's collectives
                compile_in_place(module, self.run.compile_options)
            sharded = fully_shard(
                module,
                mesh=self.mesh,
                reshard_after_forward=self.reshard_after_forward,
                mp_policy=policy,
                offload_policy=CPUOffloadPolicy() if self.run.cpu_offload else OffloadPolicy(),
                ignored_params=scalars or None,
            )
        if self.run.world.world_size > 1:
            if self.lockstep is None:
                self.lockstep = ForwardLockstep("fsdp", self.run.world.rank, self.run.timeout_s)
            lockstep = self.lockstep
            # Before FSDP2's own pre-forward (its gathers): a rank-0-only forward is one clear error, not a hang.
            model.register_forward_pre_hook(lambda m, args: lockstep.check(m.training), prepend=True)
        self.sharded.append(sharded)
        return model

    def compile(self, wrapped: nn.Module) -> None:
        pass  # the units were compiled one by one before sharding (wrap_model)

    def broadcast_into(self, tensor: torch.Tensor) -> None:
        if self.run.world.world_size > 1:
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
        return optimizer
