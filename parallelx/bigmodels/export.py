"""Weights saved as Hugging Face and safetensors load them: :func:`save_pretrained`.

    parallelx.save_pretrained(backend, model, "out/")                    # out/model.safetensors
    parallelx.save_pretrained(backend, model, "out/", max_shard_size="2GB")  # shards + their index
    GPT2LMHeadModel.from_pretrained("out/")                              # a model with a config: config.json too

Nothing is gathered.  A safetensors file is a header, then each tensor's bytes in row-major order,
one after another; a rank that keeps a dim-0 slice of a tensor (fsdp) or a contiguous run of its
flattened elements (a ZeRO-3 partition) therefore holds one contiguous run of that tensor's bytes
in the file.  Rank 0 lays the files out (the same layout on every rank: names, shapes and dtypes
only), writes the headers and sizes the files; then every rank writes its own runs at their offsets,
and the tensors a backend keeps whole are written by rank 0.  No rank holds more than its share:
the files must be on a filesystem every rank sees (one machine, or a shared one).  A URL of an
object store takes each file whole: there the pieces of one file at a time are gathered and rank 0
uploads it (:func:`upload_safetensors`).  A tied tensor is
stored once, under the first name ``state_dict`` gives it (``transformer.wte.weight``, not
``lm_head.weight``), as Hugging Face stores it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

import torch
from torch import nn

from parallelx import storage
from parallelx.bigmodels.formats import INDEX
from parallelx.errors import ParallelxError
from parallelx.parts.stateio import plain_key

__all__ = ["Layout", "Piece", "TensorInfo", "save_pretrained", "write_safetensors"]

_DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of the saved weights: the same on every rank."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Piece:
    """What this rank writes of a tensor: ``values`` (its elements, flattened) from element ``start``."""

    name: str
    start: int
    values: torch.Tensor


@dataclasses.dataclass
class Layout:
    """A model's weights as a strategy hands them to the writer (``Strategy.weight_pieces``); the
    pieces may be made one at a time (a generator), so that a converter holds one tensor at most."""

    tensors: list[TensorInfo]
    pieces: Iterable[Piece]


def whole_tensors(module: nn.Module, rank: int) -> Layout:
    """Every tensor whole, written by rank 0 (backends that keep the model whole on every rank)."""
    tensors, pieces = [], []
    for name, t in unique_state(module):
        tensors.append(TensorInfo(name, tuple(t.shape), t.dtype))
        if rank == 0:
            pieces.append(Piece(name, 0, t.detach().reshape(-1)))
    return Layout(tensors, pieces)


def whole_state(module: nn.Module, state: Mapping[str, torch.Tensor], rank: int) -> Layout:
    """``state`` (whole tensors by plain name, the same on every rank), written by rank 0, a tied
    tensor once under ``module``'s first name for it."""
    names = [name for name, _ in unique_state(module)]
    tensors = [TensorInfo(n, tuple(state[n].shape), state[n].dtype) for n in names]
    pieces = [Piece(n, 0, state[n].detach().reshape(-1)) for n in names] if rank == 0 else []
    return Layout(tensors, pieces)


def _user_module(model: nn.Module) -> nn.Module:
    inner = model
    while True:  # inside a wrapper (DeepSpeed's engine, DDP, torch.compile's) the user's model
        below = getattr(inner, "module", None)
        below = below if isinstance(below, nn.Module) else getattr(inner, "_orig_mod", None)
        if not isinstance(below, nn.Module):
            return inner
        inner = below


def unique_state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The ``state_dict`` entries (plain names), a tied tensor once under its first name."""
    seen: set[int] = set()
    out = []
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        out.append((plain_key(name), t))
    return out


def parse_size(size: int | str | None) -> int | None:
    """``"5GB"``, ``"500MB"``, ``"10KiB"`` or bytes, as Hugging Face's ``max_shard_size`` reads them."""
    if size is None or isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B\s*", size.upper().replace("IB", "iB"))
    if m is None:
        raise ParallelxError(f"max_shard_size: {size!r} is not a size such as '5GB', '500MB' or a number of bytes")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** "_KMGT".index(m.group(2) or "_"))


def plan_files(tensors: Sequence[TensorInfo], max_shard_size: int | None) -> list[list[TensorInfo]]:
    """Tensors in order, a new file whenever the next would pass ``max_shard_size`` bytes."""
    files: list[list[TensorInfo]] = [[]]
    size = 0
    for t in tensors:
        if max_shard_size is not None and files[-1] and size + t.nbytes > max_shard_size:
            files.append([])
            size = 0
        files[-1].append(t)
        size += t.nbytes
    return files


def _header(tensors: Sequence[TensorInfo], metadata: dict[str, str]) -> tuple[bytes, dict[str, int]]:
    """The safetensors header (padded to 8 bytes) and each tensor's data offset."""
    offsets: dict[str, int] = {}
    head: dict[str, Any] = {"__metadata__": metadata}
    at = 0
    for t in tensors:
        if t.dtype not in _DTYPE_NAMES:
            raise ParallelxError(f"save_pretrained: {t.name} has dtype {t.dtype}, which safetensors does not store")
        head[t.name] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + t.nbytes]}
        offsets[t.name] = at
        at += t.nbytes
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, offsets


def write_safetensors(
    layout: Layout,
    path: str | os.PathLike[str],
    *,
    rank: int,
    barrier: Callable[[], None],
    max_shard_size: int | str | None = None,
    metadata: dict[str, str] | None = None,
) -> list[Path]:
    """Write ``layout`` under the folder ``path``: ``model.safetensors``, or shards and their index
    when ``max_shard_size`` splits them.  Every rank calls it (a collective: two barriers)."""
    folder = Path(path)
    files = plan_files(layout.tensors, parse_size(max_shard_size))
    names = file_names(len(files))
    meta = {"format": "pt", **(metadata or {})}
    where: dict[str, tuple[Path, int]] = {}
    heads = []
    for fname, group in zip(names, files, strict=True):
        head, offsets = _header(group, meta)
        heads.append(head)
        where.update({n: (folder / fname, len(head) + o) for n, o in offsets.items()})
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        for fname, group, head in zip(names, files, heads, strict=True):
            with open(folder / fname, "wb") as f:
                f.write(head)
                f.truncate(len(head) + sum(t.nbytes for t in group))
        if len(files) > 1:
            (folder / INDEX).write_text(index_json(names, files))
        elif (folder / INDEX).exists():
            (folder / INDEX).unlink()  # a previous save's index would point at shards no longer written
    barrier()
    info = {t.name: t for t in layout.tensors}
    handles: dict[Path, Any] = {}  # open files
    try:
        for piece in layout.pieces:
            file, offset = where[piece.name]
            data = piece.values.detach().to("cpu").contiguous()
            if data.dtype != info[piece.name].dtype:
                raise ParallelxError(f"save_pretrained: a piece of {piece.name} is {data.dtype}, the tensor is not")
            out = handles.get(file)
            if out is None:
                out = handles[file] = open(file, "r+b")  # noqa: SIM115  (closed below, several at once)
            out.seek(offset + piece.start * data.element_size())
            out.write(data.view(torch.uint8).numpy().tobytes())
        for out in handles.values():
            out.flush()
            os.fsync(out.fileno())
    finally:
        for out in handles.values():
            out.close()
    barrier()
    return [folder / n for n in names]


def _put(data: bytes | bytearray, out: IO[bytes]) -> None:
    out.write(data)


def file_names(count: int) -> list[str]:
    """The weight files of a folder of ``count`` of them, as Hugging Face names them."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def index_json(names: Sequence[str], files: Sequence[Sequence[TensorInfo]]) -> str:
    """``model.safetensors.index.json`` of a folder of shards."""
    index = {
        "metadata": {"total_size": sum(t.nbytes for group in files for t in group)},
        "weight_map": {t.name: n for n, group in zip(names, files, strict=True) for t in group},
    }
    return json.dumps(index, indent=2, sort_keys=True)


#: The files of a folder written to a store when the caller gives no ``max_shard_size``: each file's
#: pieces meet in memory (every rank's, on every rank) before it is uploaded whole.
STORE_SHARD_SIZE = "2GB"


def upload_safetensors(
    layout: Layout,
    url: str,
    *,
    rank: int,
    all_gather_object: Callable[[Any], list[Any]],
    barrier: Callable[[], None],
    max_shard_size: int | str | None = None,
) -> list[str]:
    """Write ``layout`` under the store folder ``url``, one file at a time: every rank's pieces of the
    file gathered (a collective per file, in the same order on every rank), rank 0 puts them at their
    offsets and uploads the file whole, as every write to a store is.  A rank holds at most one file
    (``max_shard_size``; :data:`STORE_SHARD_SIZE` if None), never the whole model of a big one."""
    files = plan_files(layout.tensors, parse_size(max_shard_size if max_shard_size is not None else STORE_SHARD_SIZE))
    names = file_names(len(files))
    file_of = {t.name: i for i, group in enumerate(files) for t in group}
    info = {t.name: t for t in layout.tensors}
    mine: list[list[Piece]] = [[] for _ in files]
    for piece in layout.pieces:
        mine[file_of[piece.name]].append(piece)
    meta = {"format": "pt"}
    for fname, group, pieces in zip(names, files, mine, strict=True):
        sent = [(p.name, p.start, p.values.detach().to("cpu").contiguous()) for p in pieces]
        everyone = all_gather_object(sent)
        if rank != 0:
            continue
        head, offsets = _header(group, meta)
        data = bytearray(len(head) + sum(t.nbytes for t in group))
        data[: len(head)] = head
        for name, start, values in (entry for ranks_pieces in everyone for entry in ranks_pieces):
            if values.dtype != info[name].dtype:
                raise ParallelxError(f"save_pretrained: a piece of {name} is {values.dtype}, the tensor is not")
            at = len(head) + offsets[name] + start * values.element_size()
            raw = values.view(torch.uint8).numpy().tobytes()
            data[at : at + len(raw)] = raw
        storage.write(storage.join(url, fname), functools.partial(_put, data))
    if rank == 0:
        index = storage.join(url, INDEX)
        if len(files) > 1:
            storage.write_text(index, index_json(names, files))
        elif storage.exists(index):
            storage.remove(index)  # a previous save's index would point at shards no longer written
    barrier()  # every rank returns once the folder is complete
    return [str(storage.join(url, n)) for n in names]


class PieceSource(Protocol):
    def weight_pieces(self, model: nn.Module) -> Layout: ...


class SavingBackend(Protocol):
    """What :func:`save_pretrained` needs of a ``parallelx.Backend``."""

    @property
    def rank(self) -> int: ...

    @property
    def strategy(self) -> PieceSource: ...

    @property
    def mesh(self) -> Any: ...

    def barrier(self) -> None: ...

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]: ...

    def all_gather_object(self, obj: Any) -> list[Any]: ...


def save_pretrained(
    backend: SavingBackend,
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    max_shard_size: int | str | None = None,
    config: bool = True,
) -> list[Path] | list[str]:
    """Save ``model``'s weights (set up on ``backend``) under the folder ``path`` as Hugging Face and
    safetensors load them: ``model.safetensors``, or with ``max_shard_size`` (``"5GB"``, bytes) shards
    ``model-0000i-of-0000N.safetensors`` and ``model.safetensors.index.json``.  Every rank calls it;
    each writes the bytes it keeps (nothing is gathered; the folder must be one every rank sees).
    With ``config=True`` a model that has a Hugging Face ``config`` gets its ``config.json`` too, so
    that ``AutoModel.from_pretrained(path)`` loads it.  Returns the weight files.

    ``path`` may be a URL of an object store (``s3://bucket/model``): a store takes a file whole, so
    each file's pieces are gathered (on every rank, one file at a time) and rank 0 uploads it; the
    files are then at most ``max_shard_size``, 2GB when it is not given."""
    if backend.mesh.tensor_parallel:  # the split layers put together (a collective), rank 0 writes
        layout = whole_state(_user_module(model), backend.model_state_dict(model), backend.rank)
    else:
        layout = backend.strategy.weight_pieces(model)
    where = storage.location(path)
    files: list[Path] | list[str]
    if isinstance(where, str):
        files = upload_safetensors(
            layout,
            where,
            rank=backend.rank,
            all_gather_object=backend.all_gather_object,
            barrier=backend.barrier,
            max_shard_size=max_shard_size,
        )
    else:
        files = write_safetensors(
            layout, where, rank=backend.rank, barrier=backend.barrier, max_shard_size=max_shard_size
        )
    hf_config = getattr(_user_module(model), "config", None)
    if config and backend.rank == 0 and callable(getattr(hf_config, "save_pretrained", None)):
        if isinstance(where, str):
            storage.write_text(storage.join(where, "config.json"), hf_config.to_json_string())  # type: ignore[union-attr]
        else:
            hf_config.save_pretrained(str(where))  # type: ignore[union-attr]
    backend.barrier()
    return files
