"""ZeRO 1-3's sharded training-state checkpoints (``--zero-sharded-checkpoints``): every rank
writes only the partitions it holds, of the weights and of the optimizer state, and reads
back only its own, whatever world size and engine wrote them.

Each rank holds one run of every parameter's flattened elements: ZeRO-3 its ``1/world``
partition of each parameter; ZeRO 1 and 2 the part of each parameter that falls in its range
of the group's flat buffer (some parameters are cut anywhere, some are not on a rank at all).
Each run is handed to ``torch.distributed.checkpoint`` (DCP) as the boxes of the parameter's
own shape it covers (:mod:`backends._chunks`), so the checkpoint's index lists
every tensor at its own shape: fsdp reads its rows from it, a world of one the whole tensors,
plain ``dcp.load`` either.  Nothing is gathered; one ``all_gather_object`` of the runs' ranges
per save or load tells each rank where the others' runs lie.

Whole on every rank, so written by rank 0 alone: buffers, and under ZeRO 1 and 2 the weights
of parameters no optimizer group trains.  The per-group values of the optimizer state (Adam's
``step``) are written as plain tensors by every rank (DCP keeps one).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from parallelx import storage
from parallelx.errors import ParallelxError
from parallelx.parts.stateio import plain_key
from parallelx.storage import Location

from . import _deepspeed_zero as zero_state
from ._chunks import chunked


@dataclass
class Run:
    """This rank's run ``[start, stop)`` of a parameter's flattened elements."""

    shape: tuple[int, ...]
    start: int
    stop: int
    #: this rank's weights of the run (a view: written into on load)
    weights: torch.Tensor
    #: an optimizer state's key (None: the float32 master) -> this rank's run of it (a view)
    state: Callable[[str | None], torch.Tensor] | None


def runs(zero: Any, stage: int, module: nn.Module) -> dict[str, Run]:
    """Each parameter's run on this rank, by its name in the state dict (those with none left out)."""
    trained = {id(p) for params in zero_state.trained_groups(zero, stage) for p in params}
    out: dict[str, Run] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        shape = zero_state.full_shape(p)
        ds: Any = p
        if stage == 3:
            size = ds.ds_tensor.ds_numel
            rank = ds._z3_optimizer._get_param_partition_rank(p) if id(p) in trained else torch.distributed.get_rank()
            start, stop = min(rank * size, ds.ds_numel), min((rank + 1) * size, ds.ds_numel)
            weights = ds.ds_tensor.detach()[: stop - start]
            state = _z3_state(p, stop - start) if id(p) in trained else None
        else:
            mapping = getattr(p, "_hp_mapping", None)
            if id(p) not in trained or mapping is None:
                continue
            start = mapping.lp_fragment_address.start
            stop = start + mapping.lp_fragment_address.numel
            weights = p.detach().reshape(-1)[start:stop]
            state = mapping.get_hp_fragment
        out[plain_key(name)] = Run(shape, start, stop, weights, state)
    return out


def _z3_state(p: Any, n: int) -> Callable[[str | None], torch.Tensor]:
    def get(key: str | None) -> torch.Tensor:
        part, _ = p._z3_optimizer._get_fp32_opt_state_partition(p, release_swap_buffers=False, optim_state_key=key)
        return part.narrow(0, 0, n)

    return get


def _every_rank(mine: dict[str, Run]) -> dict[str, list[tuple[int, int]]]:
    """Each parameter's ``(start, stop)`` on every rank (``(0, 0)`` where a rank has none): one collective."""
    world = torch.distributed.get_world_size()
    found: list[Any] = [None] * world
    torch.distributed.all_gather_object(found, {k: (r.start, r.stop) for k, r in mine.items()})
    names = {k for ranges in found for k in ranges}
    return {k: [ranges.get(k, (0, 0)) for ranges in found] for k in names}


def _flat_keys(zero: Any, stage: int) -> tuple[list[str], list[str]]:
    """The optimizer state's keys: those shaped like the flat partition (cut into runs), and the
    per-group values (whole), as the base optimizer holds them now."""
    runs_keys: set[str] = set()
    whole_keys: set[str] = set()
    for g, params in enumerate(zero_state.trained_groups(zero, stage)):
        if not params:
            continue
        flat = zero_state._flat_master(zero, stage, g, params[0])
        for key, value in zero.optimizer.state.get(flat, {}).items():
            (runs_keys if torch.is_tensor(value) and value.shape == flat.shape else whole_keys).add(key)
    return sorted(runs_keys), sorted(whole_keys)


def sharded_state(zero: Any, stage: int, module: nn.Module, names: Mapping[int, str]) -> dict[str, Any]:
    """``{"model": ..., "optimizer": {"state": ..., "param_groups": ...}}`` of this rank's runs, for
    DCP to write (a collective: every rank calls it)."""
    zero_state.link_optimizer_state(zero, stage)
    mine = runs(zero, stage, module)
    every = _every_rank(mine)
    first = torch.distributed.get_rank() == 0
    model: dict[str, Any] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        key = plain_key(name)
        if key in every:
            run = mine.get(key)
            shape = run.shape if run is not None else zero_state.full_shape(value)
            weights = run.weights if run is not None else value.detach().reshape(-1)[:0]
            model[key] = chunked(weights, shape, run.start if run is not None else 0, every[key])
        elif first:
            model[key] = value.detach()
    cut, whole = _flat_keys(zero, stage)
    state: dict[str, dict[str, Any]] = {}
    groups = zero_state.trained_groups(zero, stage)
    base = zero.optimizer
    for g, params in enumerate(groups):
        flat = zero_state._flat_master(zero, stage, g, params[0]) if params else None
        for p in params:
            key = names[id(p)]
            run = mine.get(key)
            entry: dict[str, Any] = {}
            for k in cut:
                if run is not None and run.state is not None:
                    entry[k] = chunked(run.state(k).detach(), run.shape, run.start, every[key])
                else:
                    entry[k] = chunked(torch.empty(0), zero_state.full_shape(p), 0, every[key])
            for k in whole:
                value = base.state.get(flat, {}).get(k)
                if value is not None:
                    entry[k] = value.detach().clone() if torch.is_tensor(value) else torch.tensor(value)
            state[key] = entry
    param_groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in params]}
        for group, params in zip(base.param_groups, groups)
    ]
    return {"model": model, "optimizer": {"state": state, "param_groups": param_groups}}


def load_sharded_state(
    zero: Any,
    stage: int,
    module: nn.Module,
    names: Mapping[int, str],
    directory: Location,
    param_groups: list[dict[str, Any]],
) -> None:
    """Read this rank's runs of a sharded checkpoint (written by any engine at any world size) into
    the weights, the float32 masters and the optimizer state (a collective)."""
    import torch.distributed.checkpoint as dcp

    reader = storage.dcp_reader(directory)
    saved = reader.read_metadata().state_dict_metadata
    mine = runs(zero, stage, module)
    every = _every_rank(mine)
    model: dict[str, Any] = {}
    after: list[Callable[[], None]] = []
    for name, value in module.state_dict(keep_vars=True).items():
        key = plain_key(name)
        if key in every and stage == 3:  # this rank's partition, into a buffer, then into the engine's
            run = mine.get(key)
            if run is None:
                model[key] = chunked(torch.empty(0, dtype=value.dtype), zero_state.full_shape(value), 0, every[key])
                continue
            got = torch.empty(run.stop - run.start, dtype=value.dtype)
            model[key] = chunked(got, run.shape, run.start, every[key])
            after.append(_set_partition(run, got))
        else:  # whole on every rank (ZeRO 1 and 2: the weights; buffers), then the master's run from it
            got = torch.empty(zero_state.full_shape(value), dtype=value.dtype)
            model[key] = got
            after.append(_set_whole(value, got, mine.get(key)))
    optim: dict[str, Any] = {}
    cut = sorted({k.rsplit(".", 1)[1] for k in saved if k.startswith("optimizer.state.") and _is_cut(saved[k])})
    _create_state(zero, stage, cut)
    zero_state.link_optimizer_state(zero, stage)  # the runs' state views read the state made here
    for g, params in enumerate(zero_state.trained_groups(zero, stage)):
        for p in params:
            key = names[id(p)]
            run = mine.get(key)
            entry: dict[str, Any] = {}
            for k in cut:
                if f"optimizer.state.{key}.{k}" not in saved:
                    continue
                if run is not None and run.state is not None:
                    entry[k] = chunked(run.state(k), run.shape, run.start, every[key])
                else:
                    entry[k] = chunked(torch.empty(0), zero_state.full_shape(p), 0, every[key])
            for full, meta in saved.items():
                if full.startswith(f"optimizer.state.{key}.") and not _is_cut(meta):
                    k = full.rsplit(".", 1)[1]
                    entry[k] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
                    after.append(_set_group_value(zero, stage, g, p, k, entry))
            optim[key] = entry
    missing = sorted(k for k in model if f"model.{k}" not in saved)
    if missing:
        raise ParallelxError(f"deepspeed: the sharded checkpoint {storage.show(directory)} lacks {missing[:3]}")
    with warnings.catch_warnings():  # DCP's notice that DTensor succeeds ShardedTensor
        warnings.filterwarnings("ignore", message="Please use DTensor instead")
        dcp.load({"model": model, "optimizer": {"state": optim}} if optim else {"model": model}, storage_reader=reader)
    with torch.no_grad():
        for step in after:
            step()
    for group, saved_group in zip(zero.optimizer.param_groups, param_groups):
        group.update({k: v for k, v in saved_group.items() if k != "params"})


def _is_cut(meta: Any) -> bool:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return isinstance(meta, TensorStorageMetadata) and len(meta.size) > 0


def _create_state(zero: Any, stage: int, keys: list[str]) -> None:
    """Before the first step the base optimizer has no state: made here, shaped like the flat
    partitions, for the checkpoint's runs to land in."""
    base = zero.optimizer
    for g, params in enumerate(zero_state.trained_groups(zero, stage)):
        if not params:
            continue
        flat = zero_state._flat_master(zero, stage, g, params[0])
        shard = base.state[flat]
        for k in keys:
            if k not in shard:
                shard[k] = torch.zeros_like(flat)


def _set_partition(run: Run, got: torch.Tensor) -> Callable[[], None]:
    def put() -> None:
        run.weights.copy_(got)
        if run.state is not None:
            run.state(None).copy_(got)

    return put


def _set_whole(value: torch.Tensor, got: torch.Tensor, run: Run | None) -> Callable[[], None]:
    def put() -> None:
        value.data.copy_(got.to(value.device))
        if run is not None and run.state is not None:
            run.state(None).copy_(got.reshape(-1)[run.start : run.stop])

    return put


def _set_group_value(
    zero: Any, stage: int, g: int, p: nn.Parameter, k: str, entry: dict[str, Any]
) -> Callable[[], None]:
    def put() -> None:
        flat = zero_state._flat_master(zero, stage, g, p)
        zero.optimizer.state[flat][k] = entry[k].to(flat.device)

    return put
