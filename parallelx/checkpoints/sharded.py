"""Sharded training-state checkpoints: every rank writes only its shards.

A backend that shards its parameters (``fsdp`` with ``sharded_checkpoints=True``)
hands :func:`parallelx.save_training_state` this rank's shards by name
(``StateIO.sharded_state``) instead of whole tensors; they are written with
``torch.distributed.checkpoint`` (DCP) into the checkpoint's temporary
directory, beside the usual files, and published with it in one rename::

    <run_dir>/checkpoints/step-00000120/state.pt        everything but the tensors of model and optimizer
    <run_dir>/checkpoints/step-00000120/shards/          DCP: .metadata and one file per rank
    <run_dir>/checkpoints/step-00000120/rng-rank0.pt ...

No process ever holds the whole model.  Loading cuts the saved shards anew
for this world size: the sharding backend reads its own slices
(``StateIO.load_sharded_state``; from a store, only those byte ranges); any
other backend reads the whole tensors.
``python -m parallelx convert-checkpoint SRC DST`` makes one portable file of
a sharded checkpoint (:func:`convert`), the layout of an unsharded ``state.pt``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from parallelx import storage
from parallelx.bigmodels.export import Layout, Piece, TensorInfo, write_safetensors
from parallelx.errors import ParallelxError, first_line
from parallelx.parts import portable as checkpoint
from parallelx.parts.stateio import StateIO, plain_key
from parallelx.storage import Location

#: The DCP folder inside a checkpoint directory.
SHARDS = "shards"


def write(shards: dict[str, Any], directory: Path, group: Any = None) -> None:
    """Write this rank's ``{"model": ..., "optimizer": {"state": ...}}`` shards
    under ``directory/shards``.  A collective: every rank calls it, over ``group`` (by default
    the default group; an asynchronous save's writer thread passes one of its own)."""
    import torch.distributed.checkpoint as dcp

    # The param groups too (each parameter by its name), as torch's get_optimizer_state_dict gives them: plain
    # DCP code reads the optimizer's state back with set_optimizer_state_dict (docs/checkpoints.md).
    optimizer = {"state": shards["optimizer"]["state"], "param_groups": shards["optimizer"]["param_groups"]}
    tensors = {"model": shards["model"], "optimizer": optimizer}
    with warnings.catch_warnings(), dcp_errors(f"writing the shards into {directory}"):
        # ZeRO's runs are ShardedTensors: DCP's notice that DTensor succeeds them.
        warnings.filterwarnings("ignore", message="Please use DTensor instead")
        dcp.save(tensors, checkpoint_id=str(directory / SHARDS), process_group=group)


@contextlib.contextmanager
def dcp_errors(what: str) -> Iterator[None]:
    """DCP's failures (a ``CheckpointException``, which is no ``Exception``: an ``except Exception`` lets
    it through) as one ``ParallelxError`` naming ``what`` and the first rank's cause."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        rank, failure = sorted(exc.failures.items())[0]
        cause = getattr(failure, "exc", failure)
        cause = cause[0] if isinstance(cause, tuple) and cause else cause  # (exception, traceback)
        raise ParallelxError(f"{what} failed (rank {rank}: {type(cause).__name__}: {first_line(cause)})") from None


def stage(shards: dict[str, Any], group: Any = None) -> Path:
    """Write this rank's shards into a local staging folder of its own (a collective, as
    :func:`write`), for :func:`upload` to put in a store: the folder holding them."""
    staging = Path(tempfile.mkdtemp(prefix="parallelx-shards-"))
    try:
        write(shards, staging, group)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging / SHARDS


def upload(staged: Path, folder: Location) -> None:
    """Put the files :func:`stage` wrote (this rank's data file; rank 0's also the index) into
    ``folder/shards`` in the store, then remove the staging folder."""
    try:
        for f in sorted(staged.iterdir()):
            storage.upload(f, storage.join(folder, SHARDS, f.name))
    finally:
        shutil.rmtree(staged.parent, ignore_errors=True)


def skeleton(shards: dict[str, Any]) -> dict[str, Any]:
    """What ``state.pt`` keeps of a sharded optimizer state: all but its tensors (in the shards): the
    param groups, and what a backend keeps beside them (DeepSpeed: its engine's counters)."""
    return {**{k: v for k, v in shards["optimizer"].items() if k != "state"}, "state": {}}


def read_whole(directory: Location) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The model's and the optimizer's whole tensors from ``directory/shards``
    (written at any world size), on the CPU, read by this process alone."""
    folder = storage.join(directory, SHARDS)
    if not storage.is_file(storage.join(folder, ".metadata")):
        raise ParallelxError(f"{storage.show(directory)} is not a sharded checkpoint (no {SHARDS}/.metadata)")
    state = read_folder(folder, tensors_only=True)
    return state["model"], state.get("optimizer", {}).get("state", {})


def _strict_planner() -> Any:
    """DCP's default load planner, reading each non-tensor entry (a param group's value) with
    ``weights_only=True`` (DCP's own reads it with ``weights_only=False``: a folder from elsewhere could
    run code), into the dict ``dcp.load`` copies back into the caller's."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class Strict(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            self.original_state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    return Strict(flatten_state_dict=False)


def read_folder(folder: Location, *, tensors_only: bool = False) -> dict[str, Any]:
    """Everything in the DCP folder ``folder`` (local or in a store), whole, on the CPU, by this process
    alone, in the nesting it was saved with (``{"model": {...}, "optim": {"state": ..., "param_groups":
    ...}}``); its other entries read strictly (``weights_only``), or left out with ``tensors_only``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = storage.dcp_reader(folder)
    meta = reader.read_metadata()
    flat: dict[str, Any] = {}
    for key, info in meta.state_dict_metadata.items():
        if isinstance(info, TensorStorageMetadata):
            flat[key] = torch.empty(tuple(info.size), dtype=info.properties.dtype)
        elif not tensors_only:
            flat[key] = None  # read by the planner above
    with warnings.catch_warnings(), dcp_errors(f"reading {storage.show(folder)}"):
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: asked for
        dcp.load(flat, storage_reader=reader, planner=_strict_planner(), no_dist=True)
    # Back into the saved nesting: DCP's index keeps each flattened key's path (names hold dots themselves).
    paths = meta.planner_data if isinstance(meta.planner_data, dict) else {}
    nested: dict[Any, Any] = {}
    for key, value in flat.items():
        path = paths.get(key, (key,))
        at = nested
        for part in path[:-1]:
            at = at.setdefault(part, {})
        at[path[-1]] = value
    return _lists(nested)


def _lists(node: Any) -> Any:
    """A nesting of dicts with the entries of saved lists (the param groups) under int keys: those lists again."""
    if not isinstance(node, dict):
        return node
    out = {k: _lists(v) for k, v in node.items()}
    if out and all(isinstance(k, int) for k in out) and sorted(out) == list(range(len(out))):
        return [out[i] for i in range(len(out))]
    return out


def saved_keys(directory: Location) -> set[str]:
    """The model's state-dict keys in a sharded checkpoint, from its index alone."""
    meta = storage.dcp_reader(storage.join(directory, SHARDS)).read_metadata()
    return {k[len("model.") :] for k in meta.state_dict_metadata if k.startswith("model.")}


def load(io: StateIO, path: Location, model: Any, optimizer: Any, saved_optimizer: dict[str, Any]) -> None:
    """Load a sharded checkpoint's model and optimizer state through a backend's
    state part: its own slices where it shards, else the whole tensors.  Every rank calls it."""
    live = {plain_key(k) for k in io.unwrap(model).state_dict()}
    keys = saved_keys(path)
    if keys != live:
        raise ParallelxError(
            f"checkpoint {storage.show(path)} is of another model: not saved {sorted(live - keys)[:3]}, not in "
            f"this model {sorted(keys - live)[:3]}"
        )
    if io.load_sharded_state(model, optimizer, storage.join(path, SHARDS), saved_optimizer):
        return
    weights, optim = read_whole(path)
    io.load_model_state_dict(model, weights)
    io.load_named_optimizer_state(model, optimizer, {**saved_optimizer, "state": optim})


def convert(state_file: str | os.PathLike[str], dst: str | os.PathLike[str]) -> Location:
    """Write the portable single file of the sharded checkpoint whose
    ``state.pt`` is ``state_file`` to ``dst`` (a path or a URL): ``state.pt``'s layout with the
    whole model and optimizer in it, readable by ``torch.load(dst,
    weights_only=True)``.  One process, no launcher."""
    state = checkpoint.load(state_file)
    folder = storage.parent(storage.location(state_file))
    if not isinstance(state, dict) or not state.get("meta", {}).get("sharded"):
        raise ParallelxError(
            f"{storage.show(folder)} is not a sharded checkpoint: its {storage.name(storage.location(state_file))} "
            "already is the portable file"
        )
    weights, optim = read_whole(folder)
    state["model"] = weights
    state["optimizer"] = {**state["optimizer"], "state": optim}
    state["meta"] = {**state["meta"], "sharded": False}
    checkpoint.atomic_save(state, dst)
    return storage.location(dst)


def convert_to_safetensors(
    state_file: str | os.PathLike[str], dst: str | os.PathLike[str], *, max_shard_size: int | str | None = None
) -> list[Location]:
    """Write the model of the training-state checkpoint whose ``state.pt`` is ``state_file`` (sharded
    or not) under the folder ``dst`` as Hugging Face and safetensors load it (``model.safetensors``,
    or shards and their index with ``max_shard_size``).  A sharded checkpoint is read one tensor at a
    time from its shards, so no more than one tensor is ever whole in memory.  A checkpoint keeps a tied
    tensor under each of its names, and so does the file.  One process, no launcher.  ``dst`` may be a
    URL: the files are written to a local temporary folder first, then each is uploaded whole."""
    target = storage.location(dst)
    if storage.is_remote(target):
        with tempfile.TemporaryDirectory(prefix="parallelx-convert-") as staging:
            written = convert_to_safetensors(state_file, staging, max_shard_size=max_shard_size)
            for f in sorted(Path(staging).iterdir()):  # the weight files, then the index where there is one
                storage.upload(f, storage.join(target, f.name))
            return [storage.join(target, storage.name(f)) for f in written]
    state = checkpoint.load(state_file)
    if not isinstance(state, dict) or "model" not in state:
        raise ParallelxError(f"{storage.show(state_file)} is not a training-state checkpoint (no model in it)")
    if not state.get("meta", {}).get("sharded"):
        whole = {plain_key(k): v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}
        tensors = [TensorInfo(k, tuple(v.shape), v.dtype) for k, v in whole.items()]
        whole_pieces = [Piece(k, 0, v.reshape(-1)) for k, v in whole.items()]
        return list(
            write_safetensors(
                Layout(tensors, whole_pieces), dst, rank=0, barrier=lambda: None, max_shard_size=max_shard_size
            )
        )
    shards = storage.join(storage.parent(storage.location(state_file)), SHARDS)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = storage.dcp_reader(shards).read_metadata().state_dict_metadata
    keys = [k for k, m in meta.items() if k.startswith("model.") and isinstance(m, TensorStorageMetadata)]
    infos = {k: meta[k] for k in keys}
    tensors = [TensorInfo(plain_key(k[len("model.") :]), tuple(m.size), m.properties.dtype) for k, m in infos.items()]

    def read_pieces() -> Iterator[Piece]:
        for k, info in zip(keys, tensors, strict=True):
            one = {k: torch.empty(info.shape, dtype=info.dtype)}
            dcp.load(one, storage_reader=storage.dcp_reader(shards), no_dist=True)
            yield Piece(info.name, 0, one[k].reshape(-1))

    return list(
        write_safetensors(
            Layout(tensors, read_pieces()), dst, rank=0, barrier=lambda: None, max_shard_size=max_shard_size
        )
    )
