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
(``StateIO.load_sharded_state``); any other backend reads the whole tensors.
``python -m parallelx convert-checkpoint SRC DST`` makes one portable file of
a sharded checkpoint (:func:`convert`), the layout of an unsharded ``state.pt``.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch

from parallelx import storage
from parallelx.bigmodels.export import Layout, Piece, TensorInfo, write_safetensors
from parallelx.errors import ParallelxError
from parallelx.parts import portable as checkpoint
from parallelx.parts.stateio import StateIO, plain_key
from parallelx.storage import Location

#: The DCP folder inside a checkpoint directory.
SHARDS = "shards"


def write(shards: dict[str, Any], directory: Path) -> None:
    """Write this rank's ``{"model": ..., "optimizer": {"state": ...}}`` shards
    under ``directory/shards``.  A collective: every rank calls it."""
    import torch.distributed.checkpoint as dcp

    tensors = {"model": shards["model"], "optimizer": {"state": shards["optimizer"]["state"]}}
    dcp.save(tensors, checkpoint_id=str(directory / SHARDS))


def skeleton(shards: dict[str, Any]) -> dict[str, Any]:
    """What ``state.pt`` keeps of a sharded optimizer state: its param groups (the tensors are in the shards)."""
    return {"state": {}, "param_groups": shards["optimizer"]["param_groups"]}


def read_whole(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The model's and the optimizer's whole tensors from ``directory/shards``
    (written at any world size), on the CPU, read by this process alone."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = directory / SHARDS
    if not (folder / ".metadata").is_file():
        raise ParallelxError(f"{directory} is not a sharded checkpoint (no {SHARDS}/.metadata)")
    # torch's own conversion (whole tensors from the shards' index), through a temporary file.
    with tempfile.TemporaryDirectory(prefix="parallelx-whole-") as tmp:
        whole = Path(tmp) / "whole.pt"
        dcp_to_torch_save(folder, whole)
        state = torch.load(whole, map_location="cpu", weights_only=True)
    return state["model"], state.get("optimizer", {}).get("state", {})


def saved_keys(directory: Path) -> set[str]:
    """The model's state-dict keys in a sharded checkpoint, from its index alone."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(directory / SHARDS)).read_metadata()
    return {k[len("model.") :] for k in meta.state_dict_metadata if k.startswith("model.")}


def load(io: StateIO, path: Path, model: Any, optimizer: Any, saved_optimizer: dict[str, Any]) -> None:
    """Load a sharded checkpoint's model and optimizer state through a backend's
    state part: its own slices where it shards, else the whole tensors.  Every rank calls it."""
    live = {plain_key(k) for k in io.unwrap(model).state_dict()}
    keys = saved_keys(path)
    if keys != live:
        raise ParallelxError(
            f"checkpoint {path} is of another model: not saved {sorted(live - keys)[:3]}, not in "
            f"this model {sorted(keys - live)[:3]}"
        )
    if io.load_sharded_state(model, optimizer, path / SHARDS, saved_optimizer["param_groups"]):
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
    assert isinstance(folder, Path)  # DCP shards are only ever written to a local disk
    weights, optim = read_whole(folder)
    state["model"] = weights
    state["optimizer"] = {**state["optimizer"], "state": optim}
    state["meta"] = {**state["meta"], "sharded": False}
    checkpoint.atomic_save(state, dst)
    return storage.location(dst)


def _copy_into(source: Path, out: IO[bytes]) -> None:
    with open(source, "rb") as f:
        shutil.copyfileobj(f, out, 1 << 24)


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
                storage.write(storage.join(target, f.name), functools.partial(_copy_into, f))
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
    path = storage.parent(storage.location(state_file))
    assert isinstance(path, Path)  # DCP shards are only ever written to a local disk
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(path / SHARDS))
    meta = reader.read_metadata().state_dict_metadata
    keys = [k for k, m in meta.items() if k.startswith("model.") and isinstance(m, TensorStorageMetadata)]
    infos = {k: meta[k] for k in keys}
    tensors = [
        TensorInfo(plain_key(k[len("model.") :]), tuple(m.size), m.properties.dtype)  # type: ignore[union-attr]
        for k, m in infos.items()
    ]

    def read_pieces() -> Iterator[Piece]:
        for k, info in zip(keys, tensors, strict=True):
            one = {k: torch.empty(info.shape, dtype=info.dtype)}
            dcp.load(one, storage_reader=dcp.FileSystemReader(str(path / SHARDS)), no_dist=True)
            yield Piece(info.name, 0, one[k].reshape(-1))

    return list(
        write_safetensors(
            Layout(tensors, read_pieces()), dst, rank=0, barrier=lambda: None, max_shard_size=max_shard_size
        )
    )
