"""ZeRO 1-3 optimizer state in plain ``torch.optim`` layout, and ZeRO 1-3
gradient clipping as torch computes it, for the ``deepspeed`` backend.

Under ZeRO stages 1 to 3 each rank's base optimizer keeps state for its shard
of flat fp32 master tensors only, and ZeRO steps those masters and copies them
back into the weights.  A checkpoint must not depend on the world size or the
stage, so this module gathers that state whole, keyed by parameter name (the
layout of :mod:`parallelx.checkpoints.trainstate`, or by position as ``torch.optim`` keeps
it), scatters such a state back into this rank's shards, and sets the fp32
masters when weights are loaded.  It goes through DeepSpeed's
``safe_get_full_*`` / ``safe_set_full_*``, which are collectives: every rank
calls them in the same order.

Clipping: between the window's last backward and the step, each rank of ZeRO
1-3 holds its share of the averaged gradients (whole parameters, and slices
of those that straddle two partitions; under ZeRO-3 a slice of every
parameter).  :func:`reduced_gradients` lists them, :func:`global_grad_norm`
takes their norm as ``torch.nn.utils.get_total_norm`` takes the whole
gradient's on one process, and :func:`clip_` scales them in place as
``torch.nn.utils.clip_grads_with_norm_`` does, before the step applies them.

Not a backend (the leading underscore): the registry names its modules
explicitly.  ``deepspeed`` is imported inside the functions only, as everywhere
in ``backends/``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from parallelx.bigmodels.export import Layout, Piece, TensorInfo, unique_state
from parallelx.bigmodels.meta import Slot, Values, forget, put
from parallelx.errors import ParallelxError
from parallelx.parts.portable import to_cpu
from parallelx.parts.state import check_named_groups, indexed_optimizer_state, named_from_indexed


def param_names(module: nn.Module) -> dict[int, str]:
    """Each parameter's name, by ``id``."""
    return {id(p): n for n, p in module.named_parameters()}


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """A parameter's whole shape, also under ZeRO-3 (where the local tensor is a shard)."""
    return tuple(getattr(param, "ds_shape", param.shape))


def check_shapes(module: nn.Module, state: Mapping[str, Any]) -> None:
    """Raise unless every tensor of ``state`` named after a parameter of
    ``module`` has that parameter's whole shape."""
    for name, p in module.named_parameters():
        if name in state and tuple(state[name].shape) != full_shape(p):
            raise ParallelxError(
                f"deepspeed: the state for {name} has shape {tuple(state[name].shape)}, the "
                f"model's parameter {full_shape(p)}; it is of another model"
            )


def set_fp32_masters(zero: Any, stage: int, module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy loaded weights into ZeRO's fp32 master copies of the parameters
    ``zero`` (DeepSpeed's ZeRO optimizer) trains: ZeRO steps the masters and
    copies them back into the weights, so the masters must hold the loaded
    values too.  Parameters outside the optimizer's groups have no master."""
    trained = {id(p) for params in _groups(zero, stage) for p in params}
    for name, p in module.named_parameters():
        if id(p) in trained and name in state:
            set_full(p, state[name].to(p.device, torch.float32), None)


def set_full(param: torch.Tensor, value: torch.Tensor, key: str | None) -> None:
    """DeepSpeed's ``safe_set_full_fp32_param`` (``key`` None) or ``safe_set_full_optimizer_state``.
    Under ZeRO-3 the whole value is padded to the partitions first: DeepSpeed cuts each rank's part
    of the unpadded value, which the last rank's part overruns wherever the size is not a multiple of
    the world size (a 1-element bias on 2 ranks: "start (1) + length (1) exceeds dimension size (1)")."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    z3 = getattr(param, "_z3_optimizer", None)
    if z3 is None or not param.requires_grad:
        if key is None:
            safe_set_full_fp32_param(param, value)
        else:
            safe_set_full_optimizer_state(param, value, key)
        return
    part, group = z3._get_fp32_opt_state_partition(param, release_swap_buffers=False, optim_state_key=key)
    size, rank = part.numel(), z3._get_param_partition_rank(param)
    flat = value.detach().reshape(-1).to(part.device, part.dtype)
    padded = torch.zeros(max(size * (rank + 1), flat.numel()), dtype=part.dtype, device=part.device)
    padded[: flat.numel()] = flat
    part.data.copy_(padded.narrow(0, size * rank, size))
    if z3._swappable_optimizer_subgroup(group):
        z3._optimizer_states_and_gradient_swap_out(group)


def gather_named(zero: Any, stage: int, names: Mapping[int, str]) -> dict[str, Any]:
    """The ZeRO-sharded state of ``zero`` (DeepSpeed's ZeRO optimizer), whole,
    keyed by parameter name.  Tensors shaped like the shard are gathered with
    DeepSpeed's collectives (every rank calls them in the same order);
    per-group values (Adam's ``step``) are copied to every parameter, as
    torch.optim keeps them."""
    from deepspeed.utils import safe_get_full_optimizer_state

    link_optimizer_state(zero, stage)
    base = zero.optimizer
    state: dict[str, dict[str, Any]] = {}
    groups = _groups(zero, stage)
    for g, params in enumerate(groups):
        for p in params:
            flat = _flat_master(zero, stage, g, p)
            shard = base.state.get(flat, {})
            entry: dict[str, Any] = {}
            for key in sorted(shard):
                value = shard[key]
                if torch.is_tensor(value) and value.shape == flat.shape:
                    full = safe_get_full_optimizer_state(p, key)
                    entry[key] = full.detach().to("cpu", copy=True).reshape(full_shape(p))
                else:
                    entry[key] = to_cpu(value)
            if entry:
                state[names[id(p)]] = entry
    param_groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in params]}
        for group, params in zip(base.param_groups, groups)
    ]
    return {"state": state, "param_groups": param_groups}


def scatter_named(zero: Any, stage: int, names: Mapping[int, str], named: Mapping[str, Any]) -> None:
    """Put a whole state (by name) into this rank's ZeRO shards.  The base
    optimizer creates its state at the first step; before that, it is
    created here, shaped like the shards, for the values to land in."""
    base = zero.optimizer
    groups = _groups(zero, stage)
    check_named_groups(named, [[names[id(p)] for p in params] for params in groups])
    saved = named["state"]
    created = False
    for g, (group, params) in enumerate(zip(named["param_groups"], groups)):
        base.param_groups[g].update({k: v for k, v in group.items() if k != "params"})
        for p in params:
            entry = saved.get(names[id(p)])
            if not entry:
                continue
            flat = _flat_master(zero, stage, g, p)
            shard = base.state[flat]
            for key, value in entry.items():
                if torch.is_tensor(value) and tuple(value.shape) == full_shape(p):
                    if key not in shard:
                        shard[key] = torch.zeros_like(flat)
                        created = True
                else:  # a per-group value: the same for every parameter of the shard
                    shard[key] = value.clone() if torch.is_tensor(value) else value
    if created:
        link_optimizer_state(zero, stage)
    for g, params in enumerate(groups):
        for p in params:
            entry = saved.get(names[id(p)], {})
            flat = _flat_master(zero, stage, g, p)
            for key in sorted(entry):
                value = entry[key]
                if torch.is_tensor(value) and tuple(value.shape) == full_shape(p):
                    set_full(p, value.to(flat.device, flat.dtype), key)


def link_optimizer_state(zero: Any, stage: int) -> None:
    """Point every parameter's view of its optimizer state at the state of its
    group's shard, for each group that has state (ZeRO 1-2).

    DeepSpeed makes these links once, after the *first* group's first step
    (``_lazy_init_hp_params_optimizer_state`` runs once), when the later
    groups have no state yet: their parameters' views stay empty, and reading
    them fails ("exp_avg not found in optimizer state fragment").  Linking
    again (DeepSpeed's own function, on every group) reads the state the
    groups have now.  ZeRO-3 reads the shards directly."""
    if stage == 3:
        return
    from deepspeed.utils import lazy_init_hp_params_optimizer_state

    state = zero.optimizer.state
    for lp_params, flat in zip(zero.bit16_groups, zero.single_partition_of_fp32_groups):
        if flat in state:
            lazy_init_hp_params_optimizer_state(lp_params, flat, state)


def gather_indexed(zero: Any, stage: int, names: Mapping[int, str]) -> dict[str, Any]:
    """:func:`gather_named` in the layout ``torch.optim`` itself uses (positions, in group order)."""
    return indexed_optimizer_state(gather_named(zero, stage, names))


def scatter_indexed(zero: Any, stage: int, names: Mapping[int, str], state: Mapping[str, Any]) -> None:
    """:func:`scatter_named` for a plain ``torch.optim`` state (positions, in group order)."""
    groups = [[names[id(p)] for p in params] for params in _groups(zero, stage)]
    scatter_named(zero, stage, names, named_from_indexed(state, groups))


@dataclass(frozen=True)
class GradSlice:
    """This rank's share of one parameter's averaged gradient."""

    param: nn.Parameter
    #: The tensor the ZeRO step reads (the whole gradient, or this rank's slice of it).
    grad: torch.Tensor
    #: Where the slice starts in the flattened parameter.
    offset: int

    @property
    def whole(self) -> bool:
        return self.grad.numel() == full_numel(self.param)


def forget_reduced_gradients(zero: Any) -> None:
    """Drop what ZeRO has reduced since the last step and keeps apart from ``param.grad``:
    ZeRO 2's per-group sums of each backward's reduced partition (``all_grad_tensors``,
    which its ``zero_grad()`` leaves; ZeRO 3's ``zero_grad()`` restarts its own sums)."""
    pending = getattr(zero, "all_grad_tensors", None)
    if isinstance(pending, dict):
        for group in pending:
            pending[group] = None


def full_numel(param: torch.Tensor) -> int:
    """A parameter's whole number of elements, also under ZeRO-3."""
    return int(getattr(param, "ds_numel", param.numel()))


def reduced_gradients(zero: Any, stage: int) -> list[GradSlice]:
    """This rank's share of the averaged gradients that ``zero`` (DeepSpeed's
    ZeRO 1-3 optimizer) is about to step with: the whole gradient of each
    parameter this rank's partition holds entirely, a slice of each one that
    straddles partitions (under ZeRO-3, of every parameter).  Valid between
    the window's last backward and the step, which flattens these very
    tensors into its fp32 gradient: scaling them in place scales the update."""
    slices: list[GradSlice] = []
    if stage == 3:
        for g, params in enumerate(zero.fp16_groups):
            for p, grad in zip(params, _averaged(zero, g), strict=True):
                # Every rank's slice is partition_numel() long; the last one ends in padding.
                start = zero._get_param_partition_rank(p) * grad.numel()
                real = max(0, min(grad.numel(), full_numel(p) - start))
                slices.append(GradSlice(p, grad.view(-1).narrow(0, 0, real), start))
        return slices
    for g, params in enumerate(zero.params_in_partition):
        # Padding that aligns the partition is a tensor of its own: flagged
        # where it sits between parameters, unflagged at the partition's end.
        grads = [t for t in _averaged(zero, g) if not getattr(t, "_zero_padding", False)]
        if len(grads) < len(params) or any(t.numel() > p.numel() for p, t in zip(params, grads)):
            raise ParallelxError(
                f"deepspeed: ZeRO group {g} holds {len(grads)} gradient slices for "
                f"{len(params)} parameters; this DeepSpeed version lays them out differently"
            )
        for j, (p, grad) in enumerate(zip(params, grads)):
            # Only the partition's first parameter can start before it (as DeepSpeed slices them).
            slices.append(GradSlice(p, grad, int(zero.first_offset[g]) if j == 0 else 0))
    return slices


def _averaged(zero: Any, group: int) -> list[torch.Tensor]:
    grads = zero.averaged_gradients.get(group)
    if grads is None:
        raise ParallelxError(
            "deepspeed: ZeRO holds no averaged gradients here; the step must follow the "
            "backward of the window's last micro-batch"
        )
    return list(grads)


def global_grad_norm(
    slices: Sequence[GradSlice],
    params: Sequence[torch.Tensor],
    all_reduce: Callable[[torch.Tensor], torch.Tensor],
    *,
    exact: bool,
    spread: Collection[int] = (),
    per_parameter: bool = False,
) -> torch.Tensor:
    """The 2-norm of the whole averaged gradient, taken as
    ``torch.nn.utils.get_total_norm`` takes it on one process: each
    parameter's norm (in its gradients' dtype), then the norm of those norms,
    in the order of ``params`` (the optimizer's).  The same on every rank.

    A parameter that one rank holds whole gets the very norm torch computes
    (its square travels in float64, where squaring a float32 and taking the
    root back are exact).  One split between ranks: with ``exact`` its
    slices are put together first (an all-reduce of those parameters'
    gradients: under ZeRO 1-2 the few that straddle partitions, under ZeRO-3
    every parameter), so its norm too is torch's to the bit; without, the
    root of its slices' squares, which differs from torch's in the order of
    additions only.  ``all_reduce`` sums a tensor over the ranks.  ``spread``: the ids of
    parameters that are other tensors on other ranks at the same position (DeepSpeed's MoE
    experts), whose squares add up but whose slices are never put together.  ``per_parameter``: each
    parameter's norm instead (in the order of ``params``)."""
    if not params:
        return torch.zeros(())
    index = {id(p): i for i, p in enumerate(params)}
    if any(id(s.param) not in index for s in slices):
        raise ParallelxError("deepspeed: ZeRO steps a parameter that is not in the optimizer's groups")
    device = slices[0].grad.device if slices else params[0].device
    dtype = params[0].dtype
    # Row 0: the squares of this rank's slices' norms; row 1: 1 where this rank holds the parameter whole.
    stats = torch.zeros(2, len(params), dtype=torch.float64, device=device)
    if slices:
        # What get_total_norm takes of each tensor (foreach where the device has it).
        for s, norm in zip(slices, torch._foreach_norm([s.grad for s in slices], 2.0)):
            stats[0, index[id(s.param)]] += norm.double() ** 2
            stats[1, index[id(s.param)]] = float(s.whole)
    stats = all_reduce(stats)
    per_param = stats[0].sqrt().to(dtype)
    split = [i for i, held in enumerate(stats[1].tolist()) if not held and id(params[i]) not in spread]
    if exact and split:
        sizes = [full_numel(params[i]) for i in split]
        starts = dict(zip(split, itertools.accumulate([0, *sizes[:-1]])))
        flat = torch.zeros(sum(sizes), dtype=dtype, device=device)
        for s in slices:
            i = index[id(s.param)]
            if i in starts:
                flat.narrow(0, starts[i] + s.offset, s.grad.numel()).copy_(s.grad.reshape(-1))
        flat = all_reduce(flat)  # each element comes from one rank, zeros from the others: exact
        whole = [flat.narrow(0, starts[i], n) for i, n in zip(split, sizes)]
        per_param[split] = torch.stack(torch._foreach_norm(whole, 2.0)).to(dtype)
    return per_param if per_parameter else torch.linalg.vector_norm(per_param, 2.0)


def whole_gradients(
    slices: Sequence[GradSlice], params: Sequence[nn.Parameter], all_reduce: Callable[[torch.Tensor], torch.Tensor]
) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """Each parameter's whole averaged gradient (float32, on the CPU, in the
    order of ``params``), put together from every rank's slices: each element
    is held by one rank and the others add zeros, so the sum is exact.  A
    collective: every rank calls it."""
    sizes = [full_numel(p) for p in params]
    starts = dict(zip((id(p) for p in params), itertools.accumulate([0, *sizes[:-1]])))
    device = slices[0].grad.device if slices else (params[0].device if params else torch.device("cpu"))
    flat = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
    for s in slices:
        if id(s.param) in starts:
            flat.narrow(0, starts[id(s.param)] + s.offset, s.grad.numel()).copy_(s.grad.reshape(-1))
    flat = all_reduce(flat).cpu()
    return [(p, flat.narrow(0, starts[id(p)], n).reshape(full_shape(p)).clone()) for p, n in zip(params, sizes)]


def clip_(slices: Sequence[GradSlice], max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradient slices by ``max_norm / (norm + 1e-6)`` when that is
    below 1, as ``torch.nn.utils.clip_grads_with_norm_`` does: the same
    coefficient, multiplied in, so each element is what one process gets."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for s in slices:
        s.grad.mul_(coef.to(s.grad.device))


def trained_groups(zero: Any, stage: int) -> list[list[nn.Parameter]]:
    """The model's parameters of each of the optimizer's param groups, in order (ZeRO 1-3)."""
    return _groups(zero, stage)


def _groups(zero: Any, stage: int) -> list[list[nn.Parameter]]:
    """The model's parameters of each of the optimizer's param groups, in order."""
    if stage == 3:
        groups: list[list[nn.Parameter]] = [[] for _ in zero.optimizer.param_groups]
        for sub, params in enumerate(zero.fp16_groups):
            groups[zero.sub_group_to_group_id[sub]].extend(params)
        return groups
    return [list(g) for g in zero.bit16_groups]


def _flat_master(zero: Any, stage: int, group: int, param: nn.Parameter) -> torch.Tensor:
    """The flat fp32 tensor of this rank's shard that holds ``param``'s master
    copy; the base optimizer's state is keyed by it."""
    if stage == 3:
        return zero.fp32_partitioned_groups_flat[zero.grad_position[zero.get_param_id(param)][0]]
    return zero.single_partition_of_fp32_groups[group]


#: The fields of DeepSpeed's fp16 loss scale that change while it trains: on
#: the ZeRO optimizers' ``loss_scaler`` (a ``DynamicLossScaler``) and on
#: ``FP16_Optimizer``'s ``loss_scale_config`` (ZeRO 0).  The rest (window,
#: factor, minimum) comes from the config the job is started with.
LOSS_SCALE_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def _scaler(optimizer: Any) -> Any | None:
    """The object that holds the engine optimizer's fp16 loss scale, if it scales."""
    for attr in ("loss_scaler", "loss_scale_config"):
        holder = getattr(optimizer, attr, None)
        if holder is not None and hasattr(holder, "cur_scale"):
            return holder
    return None


def loss_scale_state(optimizer: Any) -> dict[str, float | int] | None:
    """The running loss scale of DeepSpeed's fp16 engine as plain numbers (a
    checkpoint that ``torch.load(weights_only=True)`` reads); None when the
    optimizer does not scale (fp32 and bf16 keep the scale at 1)."""
    holder = _scaler(optimizer)
    if holder is None or not (getattr(holder, "dynamic", False) or getattr(holder, "dynamic_loss_scale", False)):
        return None
    state: dict[str, float | int] = {}
    for field in LOSS_SCALE_FIELDS:
        value = getattr(holder, field, None)
        if value is not None:
            state[field] = float(value) if field == "cur_scale" else int(value)
    return state


def load_loss_scale_state(optimizer: Any, state: Mapping[str, float | int] | None) -> None:
    """Put a :func:`loss_scale_state` back; a checkpoint without one (saved in
    fp32 or bf16, or by another backend) leaves the configured initial scale."""
    holder = _scaler(optimizer)
    if holder is None or not state:
        return
    for field in LOSS_SCALE_FIELDS:
        if field in state and hasattr(holder, field):
            setattr(holder, field, state[field])


def materialize_partitioned(model: nn.Module, config: dict[str, Any], device: torch.device, who: str) -> None:
    """A model built under ``parallelx.init_module()`` (or given a weight file by
    ``parallelx.load_pretrained``) given its weights under ZeRO-3 without any rank holding it whole:
    module by module, its parameters partitioned empty (``deepspeed.zero.Init``'s conversion of built
    parameters), then each rank's partition written from the value's elements it keeps (a weight file
    reads only the rows that hold them).  The engine adopts parameters already partitioned."""
    import deepspeed

    values = Values(model, who)  # a model it cannot compute is refused before anything changes
    rank = torch.distributed.get_rank()
    first: Any = None
    owned: dict[int, list[Slot]] = {}
    for s in values.slots:
        owned.setdefault(id(s.owners[0][0]), []).append(s)
    # The modules with the largest tensors first: each is made whole (or its storage filled by the
    # conversion's broadcast) while the fewest partitions exist yet (see fsdp's materialize_shards).
    modules = sorted(
        model.modules(),
        key=lambda m: -max((s.meta.numel() for s in owned.get(id(m), []) if s.meta is not None), default=0),
    )
    for module in modules:
        slots = owned.get(id(module), [])
        for s in slots:
            if not s.is_param:  # buffers stay whole on every rank
                put(s, values.whole(s).to(device))
        trained = [s for s in slots if s.is_param]
        if not trained:
            continue
        assert all(s.meta is not None for s in trained)
        params: list[Any] = [put(s, torch.empty(s.meta.shape, dtype=s.meta.dtype, device=device)) for s in trained]  # type: ignore[union-attr]
        if first is None:
            # A holder of these parameters alone: zero.Init(module=) converts everything below it.
            deepspeed.zero.Init(module=nn.ParameterList(params), config_dict_or_path=config)
            first = params[0]
        else:
            first.convert_to_zero_parameters(param_list=params)
        for s, p in zip(trained, params, strict=True):
            # This rank's partition: elements [rank * size, (rank + 1) * size) of the flattened tensor.
            part = p.ds_tensor
            size = part.ds_numel
            start, stop = min(rank * size, p.ds_numel), min((rank + 1) * size, p.ds_numel)
            with torch.no_grad():
                part.data.zero_()
                if stop > start:
                    part.data[: stop - start].copy_(values.flat(s, start, stop))
    forget(model)


def weight_pieces(module: nn.Module, rank: int) -> Layout:
    """Each tensor's name, shape and dtype, and this rank's ZeRO-3 partition of each parameter as one
    run of its flattened elements (what ``parallelx.save_pretrained`` writes, nothing gathered);
    buffers, whole on every rank, are written by rank 0."""
    tensors, pieces = [], []
    for name, t in unique_state(module):
        ds: Any = t
        if hasattr(ds, "ds_tensor"):
            tensors.append(TensorInfo(name, tuple(ds.ds_shape), t.dtype))
            size = ds.ds_tensor.ds_numel
            start, stop = min(rank * size, ds.ds_numel), min((rank + 1) * size, ds.ds_numel)
            if stop > start:
                pieces.append(Piece(name, start, ds.ds_tensor.detach()[: stop - start]))
        else:
            tensors.append(TensorInfo(name, tuple(t.shape), t.dtype))
            if rank == 0:
                pieces.append(Piece(name, 0, t.detach().reshape(-1)))
    return Layout(tensors, pieces)


def share_float32_masters() -> None:
    """Let ZeRO-3 keep a float32 partition as its own master copy, as DeepSpeed means it to.

    ZeRO-3's optimizer skips the master copy of a partition that is already in the masters' dtype on
    its device (``DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions``), but it compares the
    partition's ``torch.device`` with the device's name, a ``str``, which torch never finds equal
    (0.19.8, on the CPU and on CUDA): a float32 run holds every partition twice, 0.5x the model per
    rank at 2 processes, from set-up on.  The device is a ``torch.device`` for that call only.
    Installed once per process; a later DeepSpeed that compares correctly is unaffected."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    original = Stage3._create_fp32_partitions
    if getattr(original, "__parallelx__", False):
        return

    def create_fp32_partitions(self: Any) -> Any:
        named = self.device
        if isinstance(named, str) and not self.offload_optimizer:  # offloaded masters are always copies
            self.device = torch.device(named)
        try:
            return original(self)
        finally:
            self.device = named

    create_fp32_partitions.__parallelx__ = True  # type: ignore[attr-defined]
    create_fp32_partitions.__wrapped__ = original  # type: ignore[attr-defined]
    Stage3._create_fp32_partitions = create_fp32_partitions
