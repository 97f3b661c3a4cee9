"""Whole and sharded state, and gradient norms, for the ``fsdp`` backend.

Under ``fully_shard`` every parameter, its gradient and its optimizer state
are DTensors: each rank holds one dim-0 slice.  A portable checkpoint must not
depend on that, so this module puts whole tensors together (one parameter at
a time, so that no rank ever holds more than one whole tensor on its device)
and cuts whole tensors back into this rank's slices (locally: every rank has
read the same file).  It also takes the global gradient norm as one process
takes it (:func:`grad_norm`) and hands out this rank's shards, by name, for
sharded checkpoints (:func:`sharded_state`, :func:`load_sharded_state`).

Not a backend (the leading underscore): the registry names its modules explicitly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from parallelx import storage
from parallelx.bigmodels.export import Layout, Piece, TensorInfo, unique_state
from parallelx.bigmodels.meta import Values, forget
from parallelx.errors import ParallelxError
from parallelx.parts import state as pure
from parallelx.parts.stateio import keyed_like, map_tensors, named_parameters, plain_key, plain_keys
from parallelx.storage import Location


def full(value: Any) -> Any:
    """``value`` with every DTensor put together whole, everything on the CPU.
    A collective for DTensors: every rank walks the same structure in the same order."""
    if isinstance(value, DTensor):
        return value.full_tensor().detach().to("cpu", copy=True)
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, Mapping):
        return {k: full(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(full(v) for v in value)
    return value


def like(whole: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """``whole`` laid out as ``live``: this rank's slice of it when ``live`` is a
    DTensor (cut locally, no communication), on ``live``'s device and in its dtype."""
    if isinstance(live, DTensor):
        if tuple(whole.shape) != tuple(live.shape):
            raise ParallelxError(
                f"fsdp: a saved tensor has shape {tuple(whole.shape)}, the model's "
                f"{tuple(live.shape)}; the checkpoint is of another model"
            )
        local = whole.to(live.to_local().device, live.dtype)
        return distribute_tensor(local, live.device_mesh, live.placements, src_data_rank=None)
    return whole.to(live.device, live.dtype)


def model_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The whole ``state_dict`` (plain names: ``fully_shard`` adds no prefix) on the CPU, on every rank.

    One tensor at a time (``DTensor.full_tensor``): ``get_model_state_dict``'s
    full state dict is either on rank 0 alone (``cpu_offload``) or whole on
    every rank's device at once, and this is the whole state on every rank
    with at most one whole tensor on a device."""
    return {plain_key(k): full(v) for k, v in module.state_dict().items()}


def load_model_state(module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load a whole state dict (plain names, on every rank): each rank keeps its slice of every parameter."""
    check_shapes(module, state)
    set_model_state_dict(module, keyed_like(state, module), options=StateDictOptions(full_state_dict=True))


def check_shapes(module: nn.Module, state: Mapping[str, Any]) -> None:
    """One clear error for a state of another model (torch's lists every mismatch over many lines)."""
    live = plain_keys(module.state_dict())
    for k, v in state.items():
        if k in live and torch.is_tensor(v) and tuple(v.shape) != tuple(live[k].shape):
            raise ParallelxError(
                f"fsdp: the saved {k} has shape {tuple(v.shape)}, the model's {tuple(live[k].shape)}; "
                "the checkpoint is of another model"
            )


def param_names(module: nn.Module) -> dict[int, str]:
    return named_parameters(module)


def named_state(module: nn.Module, optimizer: torch.optim.Optimizer, *, whole: bool) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name: whole tensors on the CPU
    (a collective), or, with ``whole=False``, this rank's DTensor shards as they are."""
    names = param_names(module)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    missing = [p for p in params if id(p) not in names]
    if missing:
        raise ParallelxError(
            "fsdp: the optimizer holds a parameter that is not among the model's "
            "named_parameters(); build the optimizer on model.parameters()"
        )
    state = {
        names[id(p)]: (full(optimizer.state[p]) if whole else dict(optimizer.state[p]))
        for p in params
        if p in optimizer.state
    }
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    return {"state": state, "param_groups": groups}


def load_named_state(module: nn.Module, optimizer: torch.optim.Optimizer, named: Mapping[str, Any]) -> None:
    """Load a state keyed by name (whole tensors, or shards already laid out): each rank keeps its slices."""
    pure.check_named_groups(named, [[param_names(module)[id(p)] for p in g["params"]] for g in optimizer.param_groups])
    params = {plain_key(n): p for n, p in module.named_parameters()}
    for name, entry in named["state"].items():
        p = params.get(name)
        for k, v in entry.items():
            if p is not None and torch.is_tensor(v) and v.dim() > 0 and tuple(v.shape) != tuple(p.shape):
                raise ParallelxError(
                    f"fsdp: the saved optimizer state {k} of {name} has shape {tuple(v.shape)}, the "
                    f"parameter {tuple(p.shape)}; the checkpoint is of another model"
                )
    whole = not any(isinstance(v, DTensor) for entry in named["state"].values() for v in entry.values())
    set_optimizer_state_dict(module, optimizer, dict(named), options=StateDictOptions(full_state_dict=whole))


def grad_norm(
    params: Sequence[torch.Tensor],
    *,
    exact: bool,
    all_reduce: Callable[[torch.Tensor], torch.Tensor],
    replicas: int | Sequence[int] = 1,
) -> torch.Tensor:
    """The 2-norm of the whole averaged gradient as ``torch.nn.utils.get_total_norm``
    takes it on one process (each parameter's norm, then the norm of those), the
    same on every rank.  With ``exact`` each parameter's gradient is put together
    first (one at a time), so its norm is torch's to the bit: it then scales the
    update.  Without, the root of the shards' summed squares (float64), which
    differs from torch's in the order of additions only."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    if exact:
        norms = [torch.nn.utils.get_total_norm([g.full_tensor() if isinstance(g, DTensor) else g]) for g in grads]
        return torch.linalg.vector_norm(torch.stack(norms), 2.0)
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    squares = torch.stack([torch.linalg.vector_norm(t, 2.0).double() ** 2 for t in local])
    sharded = torch.tensor([isinstance(g, DTensor) for g in grads], device=squares.device)
    # A replicated (not sharded) gradient is whole on every rank: count it once.  Under HSDP each
    # of the ``replicas`` groups holds every shard (the same values once synchronised): once too.
    # ``replicas``: how many ranks hold each slice (one count, or one per parameter under tensor parallelism).
    copies = torch.as_tensor(replicas, dtype=torch.float64, device=squares.device)
    summed = torch.where(sharded, all_reduce(squares) / copies, squares)
    return torch.linalg.vector_norm(summed.sqrt().to(grads[0].dtype), 2.0)


def clip_(params: Sequence[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale each rank's slices by ``max_norm / (norm + 1e-6)`` when that is below 1,
    multiplied in as ``torch.nn.utils.clip_grads_with_norm_`` does."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                local.mul_(coef.to(local.device))


# ------------------------------------------------------------- sharded checkpoints
def sharded_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's shards by name, for ``torch.distributed.checkpoint``: nothing is gathered."""
    return {"model": plain_keys(module.state_dict()), "optimizer": named_state(module, optimizer, whole=False)}


def copy_shards(shards: Any, copy: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """:meth:`StateIO.copy_shards`: a DTensor's copy is one over ``copy`` of its local tensor, with its
    spec (its mesh, placements and global shape): what DCP needs to write it, no collective, and the
    copy stays where ``copy`` put it (``DTensor.from_local`` would move it to the mesh's device)."""

    def one(x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, DTensor):
            return DTensor(copy(x.to_local()), x._spec, requires_grad=False)
        return copy(x)

    return map_tensors(shards, one)


def load_sharded_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, directory: Location, param_groups: list[dict[str, Any]]
) -> None:
    """Read this rank's slices of a sharded checkpoint (written at any world
    size: torch.distributed.checkpoint cuts the saved shards anew) straight
    into the model's and the optimizer's shards, from a local folder or a store.  A collective."""
    import torch.distributed.checkpoint as dcp

    saved = storage.dcp_reader(directory).read_metadata().state_dict_metadata
    params = dict(module.named_parameters())
    # The optimizer may have no state yet (it is made at the first step): a
    # template from the file's own index, shaped as the parameters' shards.
    template: dict[str, dict[str, torch.Tensor]] = {}
    for key, meta in saved.items():
        if not key.startswith("optimizer.state."):
            continue
        name, field = key[len("optimizer.state.") :].rsplit(".", 1)
        p = params.get(name)
        if p is None:
            raise ParallelxError(
                f"fsdp: the sharded checkpoint {storage.show(directory)} holds optimizer state for {name}, "
                "which this model does not have"
            )
        if not isinstance(meta, TensorStorageMetadata):
            raise ParallelxError(
                f"fsdp: the sharded checkpoint {storage.show(directory)} holds {key} as bytes, not a tensor"
            )
        dtype = meta.properties.dtype
        if tuple(meta.size) == tuple(p.shape):
            template.setdefault(name, {})[field] = torch.zeros_like(p, dtype=dtype)
        else:
            template.setdefault(name, {})[field] = torch.zeros(tuple(meta.size), dtype=dtype)
    model_sd = plain_keys(module.state_dict())
    target = {"model": model_sd, "optimizer": {"state": template}}
    dcp.load(target, storage_reader=storage.dcp_reader(directory))
    set_model_state_dict(module, keyed_like(model_sd, module), options=StateDictOptions(full_state_dict=False))
    load_named_state(module, optimizer, {"state": template, "param_groups": param_groups})


def materialize_shards(module: nn.Module, values: Values, device: torch.device) -> None:
    """Give a model sharded on the meta device its weights: each tensor computed whole on the CPU
    (``values``, the same on every rank), this rank's slice kept, the rest dropped at once; a rank
    holds its shards and one whole tensor at most.  The largest tensors first: a shard's pages are
    only resident once written, so each whole tensor then meets the fewest shards already written
    (an untied output layer last in the model would otherwise sit on nearly all of them)."""
    kept = {n: full(t) for n, t in [*module.named_parameters(), *module.named_buffers()] if not _is_meta(t)}
    module.to_empty(device=device)
    tensors = sorted([*module.named_parameters(), *module.named_buffers()], key=lambda nt: -nt[1].numel())
    with torch.no_grad():
        for name, t in tensors:
            if name in kept:
                whole = kept[name]
                t.to_local().copy_(cast(DTensor, like(whole, t)).to_local()) if isinstance(t, DTensor) else t.copy_(
                    whole
                )
                continue
            slot = values.slot(name)
            if slot is None:
                raise ParallelxError(f"fsdp: no value for {name} of a model built on the meta device")
            if isinstance(t, DTensor):
                # This rank's rows only (a weight file reads just those).
                shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
                local = t.to_local()
                if local.numel():
                    local.copy_(values.rows(slot, offset[0], offset[0] + shape[0]).view(local.shape))
            else:
                t.copy_(values.whole(slot))
    forget(module)


def _is_meta(t: torch.Tensor) -> bool:
    return t.to_local().is_meta if isinstance(t, DTensor) else t.is_meta


def first_replica(t: DTensor) -> bool:
    """Whether this rank is the first of those holding ``t``'s local part (HSDP keeps a copy in each
    replica group; on a 1-D mesh every rank is)."""
    where = t.device_mesh.get_coordinate()
    return where is not None and all(where[i] == 0 for i, p in enumerate(t.placements) if p.is_replicate())


def weight_pieces(module: nn.Module, rank: int) -> Layout:
    """Each tensor's name, shape and dtype, and this rank's rows of each sharded one as one run of its
    flattened elements (what ``parallelx.save_pretrained`` writes, nothing gathered); a tensor kept
    whole on every rank is written by rank 0."""
    tensors, pieces = [], []
    for name, t in unique_state(module):
        tensors.append(TensorInfo(name, tuple(t.shape), t.dtype))
        if isinstance(t, DTensor):
            if not first_replica(t):  # HSDP: another group writes the same rows
                continue
            _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            local = t.to_local()
            if local.numel():
                row = local[0].numel() if local.dim() else 1
                pieces.append(Piece(name, offset[0] * row, local.detach().reshape(-1)))
        elif rank == 0:
            pieces.append(Piece(name, 0, t.detach().reshape(-1)))
    return Layout(tensors, pieces)
