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
the files must be on a filesystem every rank sees (one machine, or a shared one).  A tied tensor is
stored once, under the first name ``state_dict`` gives it (``transformer.wte.weight``, not
``lm_head.weight``), as Hugging Face stores it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

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
    names = (
        ["model.safetensors"]
        if len(files) == 1
        else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    )
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
            index = {
                "metadata": {"total_size": sum(t.nbytes for t in layout.tensors)},
                "weight_map": {t.name: n for n, group in zip(names, files, strict=True) for t in group},
            }
            (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
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


def save_pretrained(
    backend: SavingBackend,
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    max_shard_size: int | str | None = None,
    config: bool = True,
) -> list[Path]:
    """Save ``model``'s weights (set up on ``backend``) under the folder ``path`` as Hugging Face and
    safetensors load them: ``model.safetensors``, or with ``max_shard_size`` (``"5GB"``, bytes) shards
    ``model-0000i-of-0000N.safetensors`` and ``model.safetensors.index.json``.  Every rank calls it;
    each writes the bytes it keeps (nothing is gathered; the folder must be one every rank sees).
    With ``config=True`` a model that has a Hugging Face ``config`` gets its ``config.json`` too, so
    that ``AutoModel.from_pretrained(path)`` loads it.  Returns the weight files."""
    if backend.mesh.tensor_parallel:  # the split layers put together (a collective), rank 0 writes
        layout = whole_state(_user_module(model), backend.model_state_dict(model), backend.rank)
    else:
        layout = backend.strategy.weight_pieces(model)
    files = write_safetensors(layout, path, rank=backend.rank, barrier=backend.barrier, max_shard_size=max_shard_size)
    hf_config = getattr(_user_module(model), "config", None)
    if config and backend.rank == 0 and callable(getattr(hf_config, "save_pretrained", None)):
        hf_config.save_pretrained(str(path))  # type: ignore[union-attr]
    backend.barrier()
    return files
