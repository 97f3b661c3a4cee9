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

Which modules are sharded (``shard=``): by default each child module holding
a large share of the parameters (:func:`default_units`), then the root, which
takes the rest; or a callable ``module -> bool``, or a list of module types
(``--fsdp-shard Linear,Conv2d`` on the command line).  The loop's options map
onto FSDP2 as: accumulation -> ``set_requires_gradient_sync(False)`` inside a
window; clipping -> the global norm taken as one process takes it
(``_fsdp_state.grad_norm``); ``bf16-mixed`` -> autocast over float32 FSDP2
(FSDP2's own ``MixedPrecisionPolicy`` casts the weights, which changes the
numbers); ``--grad-compression`` -> ``MixedPrecisionPolicy(reduce_dtype=...)``.

Checkpoints are portable (whole tensors, plain names, on the CPU) like every
backend's; with ``sharded_checkpoints=True`` (``--fsdp-sharded-checkpoints``)
the training-state checkpoints hold each rank's shards instead, written with
torch.distributed.checkpoint (see :mod:`parallelx.sharded`).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from parallelx.backends import _fsdp_state as fsdp_state
from parallelx.backends.ddp import TORCHRUN
from parallelx.errors import ParallelxError
from parallelx.process_group import ProcessGroupBackend
from parallelx.state import named_from_indexed

#: What ``shard=`` accepts: a predicate on modules, or module types.
ShardPolicy = Callable[[nn.Module], bool] | Sequence[type[nn.Module]] | None

#: A child module is a unit of its own when it holds at least this share of the parameters.
LARGE_SHARE = 0.1


def default_units(model: nn.Module, share: float = LARGE_SHARE) -> list[nn.Module]:
    """The modules to shard before the root, innermost first: each submodule
    that holds at least ``share`` of the model's parameters not already in a
    unit below it.  The root then takes what is left."""
    total = sum(p.numel() for p in model.parameters())
    units: list[nn.Module] = []
    taken: set[int] = set()

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        if module is model:
            return
        left = sum(p.numel() for p in module.parameters() if id(p) not in taken)
        if total and left >= share * total:
            units.append(module)
            taken.update(id(p) for p in module.parameters())

    visit(model)
    return units


def parse_shard(text: str | None) -> list[type[nn.Module]] | None:
    """``--fsdp-shard``: ``auto`` (the default units) or comma-separated names of ``torch.nn`` module types."""
    if text is None or text == "auto":
        return None
    types = []
    for name in (t.strip() for t in text.split(",") if t.strip()):
        cls = getattr(nn, name, None)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ParallelxError(
                f"fsdp: --fsdp-shard names {name!r}, which is not a torch.nn module type; "
                "give names such as Linear,Conv2d (or auto)"
            )
        types.append(cls)
    return types


class FSDPBackend(ProcessGroupBackend):
    name = "fsdp"
    summary = "`fully_shard` (FSDP2): parameters, gradients and optimizer state sharded; NCCL on GPUs, Gloo on the CPU"
    launcher = TORCHRUN
    probe_code = (
        "import torch, torch.distributed.fsdp as f; print('torch', torch.__version__, "
        "'fully_shard' if hasattr(f, 'fully_shard') else 'no fully_shard')"
    )

    # Every environment that gives a torch.distributed rendezvous, and none (a world of one).
    environments = ("ray", "torchrun", "deepspeed", "slurm", "env", "local")

    def __init__(
        self,
        *,
        shard: ShardPolicy = None,
        reshard_after_forward: bool = True,
        sharded_checkpoints: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if shard is not None and not callable(shard):
            shard = tuple(shard)
            if not all(isinstance(t, type) and issubclass(t, nn.Module) for t in shard):
                raise ParallelxError(f"fsdp: shard= takes a callable or module types, got {shard!r}")
        self.shard = shard
        self.reshard_after_forward = bool(reshard_after_forward)
        self.sharded_checkpoints = bool(sharded_checkpoints)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("fsdp")
        group.add_argument(
            "--fsdp-shard",
            default=None,
            metavar="TYPES",
            help="modules sharded as units before the root: auto (each child holding 10%% or more "
            "of the parameters) or torch.nn type names, e.g. Linear,Conv2d (default: auto)"
            "%(default).0s",
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
            shard=parse_shard(getattr(args, "fsdp_shard", None)),
            reshard_after_forward=not getattr(args, "fsdp_no_reshard_after_forward", False),
            sharded_checkpoints=getattr(args, "fsdp_sharded_checkpoints", False),
        )
        return options

    def _init(self) -> None:
        self._join_rendezvous()
        # Explicit, on this process's device type: never FSDP2's accelerator default.
        self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        self._models: list[nn.Module] = []
        self._renamed: dict[int, tuple[nn.Module, str]] = {}

    # ------------------------------------------------------------ wrapping
    def _units(self, model: nn.Module) -> list[nn.Module]:
        if self.shard is None:
            return default_units(model)
        if callable(self.shard):
            chosen = [m for m in model.modules() if m is not model and self.shard(m)]
        else:
            chosen = [m for m in model.modules() if m is not model and isinstance(m, tuple(self.shard))]
        # Innermost first, as fully_shard wants them.
        return [m for m in reversed(chosen) if any(True for _ in m.parameters())]

    def _wrap_model(self, model: nn.Module) -> nn.Module:
        if isinstance(model, FSDPModule):
            raise ParallelxError("fsdp: this model is already sharded")
        model = model.to(self.device)
        # Rank 0's parameters and buffers on every rank, as DDP does at construction.
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                self._broadcast_into(t)
        # The optimizer was built on the parameters fully_shard replaces: remember their names.
        self._renamed.update({id(p): (model, n) for n, p in model.named_parameters()})
        # The wire type is built in here: set_options(grad_compression=...) applies to models wrapped later.
        policy = MixedPrecisionPolicy(reduce_dtype=self.options.wire_dtype)  # None: the gradients' dtype
        options = dict(mesh=self.mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=policy)
        for unit in self._units(model):
            fully_shard(unit, **options)
        fully_shard(model, **options)
        self._models.append(model)
        return model

    def _broadcast_into(self, tensor: torch.Tensor) -> None:
        if self.world_size > 1:
            buf = tensor.detach().to(self._comm_device(tensor))
            dist.broadcast(buf, src=0)
            tensor.copy_(buf)

    def _wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        # Point the user's optimizer at the sharded parameters, by name.
        swapped: dict[int, nn.Parameter] = {}
        for group in optimizer.param_groups:
            new = []
            for p in group["params"]:
                if id(p) not in self._renamed:
                    if any(p is q for m in self._models for q in m.parameters()):
                        new.append(p)
                        continue
                    raise ParallelxError(
                        "fsdp: this optimizer's parameters belong to no model passed to "
                        "wrap_model; call `model = backend.wrap_model(model)` first"
                    )
                model, name = self._renamed.pop(id(p))
                swapped[id(p)] = model.get_parameter(name)
                new.append(swapped[id(p)])
            group["params"] = new
        for old_id, p in swapped.items():
            old = next((q for q in optimizer.state if id(q) == old_id), None)
            if old is not None:  # state made before set-up: now whole tensors for sharded parameters
                optimizer.state[p] = {
                    k: fsdp_state.like(v, p) if torch.is_tensor(v) and v.dim() else v
                    for k, v in optimizer.state.pop(old).items()
                }
        if self.world_size > 1:
            # Backend.wrap_optimizer looked for the models by the parameters before the swap.
            self._buffer_sync.attach([p for g in optimizer.param_groups for p in g["params"]], optimizer)
        return optimizer

    # ------------------------------------------------------ the training loop
    def _no_sync(self) -> contextlib.AbstractContextManager[Any]:
        # Gradients stay whole and local inside a window; the last micro-batch reduce-scatters their sum.
        @contextlib.contextmanager
        def local() -> Any:
            for m in self._models:
                m.set_requires_gradient_sync(False)  # type: ignore[operator]
            try:
                yield
            finally:
                for m in self._models:
                    m.set_requires_gradient_sync(True)  # type: ignore[operator]

        return local()

    def _clip_gradients(self, optimizer: torch.optim.Optimizer, max_norm: float | None) -> torch.Tensor | None:
        # When it clips the norm scales the update: each parameter's whole gradient norm, as torch's to the bit.
        norm = fsdp_state.grad_norm(
            optimizer, exact=max_norm is not None, all_reduce=lambda t: self.all_reduce(t, "sum")
        )
        if max_norm is not None:
            fsdp_state.clip_(optimizer, max_norm, norm)
        return norm

    def _apply_step(self, optimizer: torch.optim.Optimizer) -> bool:
        scaler = self.precision.scaler
        if scaler is not None:
            # 16-mixed: each rank checked only its slices for inf/nan; skip on every rank together.
            found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
            for device, flag in found.items():
                found[device] = self.all_reduce(flag, "max")
        return super()._apply_step(optimizer)

    # ------------------------------------------------------------ checkpoints
    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return fsdp_state.model_state(self.unwrap(model))

    def optimizer_state_dict(self, optimizer: Any) -> dict[str, Any] | None:
        return fsdp_state.full(optimizer.state_dict())

    def named_optimizer_state(self, model: nn.Module, optimizer: Any) -> dict[str, Any]:
        return fsdp_state.named_state(self.unwrap(model), optimizer, whole=True)

    def load_named_optimizer_state(self, model: nn.Module, optimizer: Any, state: Any) -> None:
        fsdp_state.load_named_state(self.unwrap(model), optimizer, state)

    def load_state_dict(self, target: nn.Module | Any, state: Any) -> None:
        if isinstance(target, nn.Module):
            fsdp_state.load_model_state(self.unwrap(target), state)
            return
        # A plain torch.optim state (positions, in group order), as optimizer_state_dict gives.
        model = next(
            (
                m
                for m in self._models
                if any(p is q for g in target.param_groups for p in g["params"] for q in m.parameters())
            ),
            None,
        )
        if model is None:
            raise ParallelxError("fsdp: this optimizer trains no model set up by this backend")
        names = [[fsdp_state.param_names(model)[id(p)] for p in g["params"]] for g in target.param_groups]
        fsdp_state.load_named_state(model, target, named_from_indexed(state, names))

    def sharded_state(self, model: nn.Module, optimizer: Any) -> dict[str, Any] | None:
        return fsdp_state.sharded_state(self.unwrap(model), optimizer) if self.sharded_checkpoints else None

    def load_sharded_state(
        self, model: nn.Module, optimizer: Any, directory: Any, param_groups: list[dict[str, Any]]
    ) -> bool:
        fsdp_state.load_sharded_state(self.unwrap(model), optimizer, directory, param_groups)
        return True
