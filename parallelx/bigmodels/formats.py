"""Weight files read by slice, and their names matched to a model's.

:func:`open_weights` opens a plain ``torch.save`` state dict (memory-mapped), one ``.safetensors``
file, or a Hugging Face model folder (``model.safetensors``, or shards with
``model.safetensors.index.json``; ``pytorch_model.bin``) as one :class:`WeightFile`: names, shapes and
dtypes from the headers, and :meth:`WeightFile.rows` reading a tensor's dim-0 rows only
(safetensors' ``get_slice``: only those bytes leave the disk).  :attr:`WeightFile.bytes_read`
counts what was read, so a test can show that a rank read its share.

Each of those may be a URL of an object store (``s3://bucket/llama``, :mod:`parallelx.storage`):
a safetensors header is one ranged read, and a tensor's rows another, so a rank fetches only its
share there too; a ``torch.save`` file in a store is read whole into memory (it has no index of
its tensors to read from).

A local ``torch.distributed.checkpoint`` folder (torchtitan's model-only checkpoints, PyTorch's FSDP2
example's ``{"model", "optim"}`` ones, parallelx's sharded training state) is read too, a whole
tensor at a time (DCP's files hold its writers' shards, not rows).

:func:`match_names` pairs a model's names with a file's: equal once ``_orig_mod.`` (torch.compile),
a leading ``module.`` (DDP, DataParallel) and ``_checkpoint_wrapped_module.`` (activation
checkpointing) are set aside on both sides, as the portable checkpoints match them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from parallelx import storage
from parallelx.bigmodels import deepspeed_files
from parallelx.errors import ParallelxError
from parallelx.storage import Location

__all__ = ["INDEX", "WeightFile", "match_names", "normal_name", "open_weights"]

#: The index of a sharded Hugging Face folder.
INDEX = "model.safetensors.index.json"
#: Name segments wrappers add, set aside when names are matched.
WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module")

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def normal_name(name: str) -> str:
    """``name`` without wrappers' segments and a leading ``module.``."""
    parts = [p for p in name.split(".") if p not in WRAPPER_SEGMENTS]
    while len(parts) > 1 and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


@dataclasses.dataclass
class WeightFile:
    """Tensors on disk, by name, read a slice at a time."""

    #: name -> (file: a local path or a URL, shape, dtype)
    entries: dict[str, tuple[Location, tuple[int, ...], torch.dtype]]
    #: Bytes handed out by :meth:`rows` so far (what left the disk or the store, rounded to rows).
    bytes_read: int = 0
    _handles: dict[Location, Any] = dataclasses.field(default_factory=dict)

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1]

    def dtype(self, name: str) -> torch.dtype:
        return self.entries[name][2]

    def total_bytes(self) -> int:
        return sum(_numel(s) * d.itemsize for _, s, d in self.entries.values())

    def rows(
        self, name: str, start: int | None = None, stop: int | None = None, columns: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """Rows ``start:stop`` of tensor ``name`` (all of it by default), in memory of their own; with
        ``columns``, only those columns (dim 1) of the rows: a local file reads just them, a store
        the rows' whole ranges (one ranged read), of which the columns are kept."""
        path, shape, _ = self.entries[name]
        handle = self._open(path)
        if columns is not None and len(shape) < 2:
            raise ValueError(f"{name} has no columns to take (shape {shape})")
        cols = slice(*columns) if columns is not None else slice(None)
        if _is_safetensors(path):
            piece = handle.get_slice(name)
            if not shape:
                value = piece[:]
            elif isinstance(piece, _RemoteSlice):
                value = piece[start:stop]
                self.bytes_read += value.numel() * value.element_size()
                return value[:, cols].contiguous() if columns is not None else value
            else:
                value = piece[start:stop, cols] if columns is not None else piece[start:stop]
            value = value.clone() if not value.is_contiguous() else value
        else:  # a memory-mapped torch.save file: only the pages of the rows are touched
            whole = handle[name]
            value = (whole[start:stop, cols] if columns is not None else whole[start:stop] if shape else whole).clone()
            if isinstance(handle, _DcpFolder):  # read whole
                self.bytes_read += whole.numel() * whole.element_size()
                return value
        self.bytes_read += value.numel() * value.element_size()
        return value

    def close(self) -> None:
        self._handles.clear()

    def _open(self, path: Location) -> Any:
        handle = self._handles.get(path)
        if handle is None:
            if not _is_safetensors(path):
                handle = _torch_state(path)
            elif storage.is_remote(path):
                handle = _RemoteSafetensors(str(path))
            else:
                from safetensors import safe_open

                handle = safe_open(str(path), framework="pt")
            self._handles[path] = handle
        return handle


def _is_safetensors(path: Location) -> bool:
    return storage.name(path).endswith(".safetensors")


def _read_header(path: Location) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (8 bytes of its length, then JSON) and where its data starts: two
    short reads, no tensor."""
    length = int.from_bytes(storage.read_range(path, 0, 8), "little")
    return json.loads(storage.read_range(path, 8, 8 + length)), 8 + length


class _RemoteSafetensors:
    """A safetensors file in a store, read as ``safe_open`` reads a local one: the header once, then
    each slice asked for by one ranged read of its rows."""

    def __init__(self, loc: str) -> None:
        self.loc = loc
        self.header, self.data_start = _read_header(loc)

    def get_slice(self, name: str) -> _RemoteSlice:
        return _RemoteSlice(self, name)


class _RemoteSlice:
    def __init__(self, file: _RemoteSafetensors, name: str) -> None:
        info = file.header[name]
        self.file = file
        self.shape = tuple(int(n) for n in info["shape"])
        self.dtype = _SAFETENSORS_DTYPES[info["dtype"]]
        self.begin, self.end = (int(x) for x in info["data_offsets"])

    def __getitem__(self, rows: slice) -> torch.Tensor:
        if not self.shape:  # a 0-dim tensor: its one element
            data = storage.read_range(self.file.loc, self.file.data_start + self.begin, self.file.data_start + self.end)
            return torch.frombuffer(bytearray(data), dtype=self.dtype).reshape(())
        start, stop, step = rows.indices(self.shape[0])
        assert step == 1, "rows are read as one range"
        stop = max(start, stop)
        row_bytes = (self.end - self.begin) // self.shape[0] if self.shape[0] else 0
        first = self.file.data_start + self.begin + start * row_bytes
        data = storage.read_range(self.file.loc, first, first + (stop - start) * row_bytes) if stop > start else b""
        flat = torch.frombuffer(bytearray(data), dtype=self.dtype) if data else torch.empty(0, dtype=self.dtype)
        return flat.reshape(stop - start, *self.shape[1:])


def _torch_state(loc: Location) -> Mapping[str, torch.Tensor]:
    """A ``torch.save`` state dict (a checkpoint's ``state_dict`` entry where it has one): memory-mapped
    from a disk, read whole from a store (it has no index to read a slice by)."""
    if storage.is_remote(loc):
        state = storage.load(loc)
    else:
        state = torch.load(loc, map_location="cpu", mmap=True, weights_only=True)
    if isinstance(state, Mapping) and isinstance(state.get("state_dict"), Mapping):
        state = state["state_dict"]
    if not isinstance(state, Mapping):
        raise ParallelxError(f"{storage.show(loc)}: not a state dict (a mapping of names to tensors)")
    return state


class _DcpFolder(Mapping[str, torch.Tensor]):
    """A ``torch.distributed.checkpoint`` folder (``.metadata`` and the writers' files) read as weights,
    by this process alone: a model-only checkpoint (torchtitan's) by its own names, a training
    checkpoint (PyTorch's FSDP2 example: ``{"model": ..., "optim": ...}``; parallelx's sharded one:
    ``{"model": ..., "optimizer": ...}``) by its model's, the ``model.`` prefix set aside.  DCP's
    files hold the writers' shards, not rows: each tensor is read whole (put together from every
    writer's shard), one at a time."""

    def __init__(self, folder: Location) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.folder = folder
        meta = storage.dcp_reader(folder).read_metadata().state_dict_metadata
        tensors = {k: m for k, m in meta.items() if isinstance(m, TensorStorageMetadata)}
        model = {k[len("model.") :]: k for k in tensors if k.startswith("model.")}
        #: name -> (DCP's key, shape, dtype)
        self.tensors = {
            name: (key, tuple(tensors[key].size), tensors[key].properties.dtype)
            for name, key in (model.items() if model and len(model) < len(tensors) else ((k, k) for k in tensors))
        }
        self._last: tuple[str, torch.Tensor] | None = None  # a slot's rows asked for one after another

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._last is not None and self._last[0] == name:
            return self._last[1]
        import torch.distributed.checkpoint as dcp

        key, shape, dtype = self.tensors[name]
        one = {key: torch.empty(shape, dtype=dtype)}
        with warnings.catch_warnings():  # "... uninitialized, assuming ... a single process": asked for
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(one, storage_reader=storage.dcp_reader(self.folder), no_dist=True)
        self._last = (name, one[key])
        return one[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def _is_dcp(loc: Location) -> bool:
    return (loc / ".metadata").is_file() if isinstance(loc, Path) else storage.is_file(storage.join(loc, ".metadata"))


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _listed(header: Mapping[str, Any], path: Location) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Each tensor's shape and dtype from a safetensors header."""
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ParallelxError(
                f"{storage.show(path)}: tensor {name} has dtype {info['dtype']}, which parallelx does not read"
            )
        out[name] = (tuple(info["shape"]), dtype)
    return out


def open_weights(path: str | os.PathLike[str]) -> WeightFile:
    """The weights at ``path`` (a local path or a URL): a ``.safetensors`` file, a ``torch.save`` state
    dict, a Hugging Face model folder (sharded safetensors with ``model.safetensors.index.json``,
    ``model.safetensors``, or ``pytorch_model.bin``), a ``torch.distributed.checkpoint`` folder
    (:class:`_DcpFolder`), or a DeepSpeed checkpoint folder (:mod:`parallelx.bigmodels.deepspeed_files`)."""
    loc = storage.location(path)
    files: list[Location]
    if _is_dcp(loc):
        folder = _DcpFolder(loc)
        listed = {name: (loc, shape, dtype) for name, (_, shape, dtype) in folder.tensors.items()}
        return WeightFile(listed, _handles={loc: folder})
    if storage.is_file(loc):
        files = [loc]
    elif storage.is_file(storage.join(loc, INDEX)):
        index = json.loads(storage.read_bytes(storage.join(loc, INDEX)))
        files = [storage.join(loc, f) for f in sorted(set(index["weight_map"].values()))]
    elif storage.is_file(storage.join(loc, "model.safetensors")):
        files = [storage.join(loc, "model.safetensors")]
    elif storage.is_file(storage.join(loc, "pytorch_model.bin")):
        files = [storage.join(loc, "pytorch_model.bin")]
    elif (step := deepspeed_files.tag_folder(loc)) is not None:  # put together whole, by DeepSpeed's own code
        merged = deepspeed_files.read(step)
        listed = {name: (loc, tuple(v.shape), v.dtype) for name, v in merged.items()}
        return WeightFile(listed, _handles={loc: merged})
    elif (isinstance(loc, Path) and loc.is_dir()) or storage.listdir(loc):
        raise ParallelxError(
            f"{storage.show(loc)}: no weights found (expected {INDEX}, model.safetensors or pytorch_model.bin in "
            "the folder, a torch.distributed.checkpoint folder or a DeepSpeed checkpoint folder)"
        )
    else:
        raise ParallelxError(f"{storage.show(loc)}: no such file or folder of weights")
    entries: dict[str, tuple[Location, tuple[int, ...], torch.dtype]] = {}
    # What was opened to list the tensors is kept for reading them: a store's file is not fetched twice.
    handles: dict[Location, Any] = {}
    for f in files:
        if not _is_safetensors(f):
            handles[f] = state = _torch_state(f)
            found = {k: (tuple(v.shape), v.dtype) for k, v in state.items() if isinstance(v, torch.Tensor)}
        elif storage.is_remote(f):
            handles[f] = remote = _RemoteSafetensors(str(f))
            found = _listed(remote.header, f)
        else:
            found = _listed(_read_header(f)[0], f)
        for name, (shape, dtype) in found.items():
            entries[name] = (f, shape, dtype)
    return WeightFile(entries, _handles=handles)


@dataclasses.dataclass
class Matched:
    """A model's names paired with a file's."""

    #: model name -> file name
    pairs: dict[str, str]
    #: model names with no file name
    missing: list[str]
    #: file names no model name took
    unexpected: list[str]
    #: (model name, model shape, file shape)
    misshaped: list[tuple[str, tuple[int, ...], tuple[int, ...]]]

    def check(self, *, strict: bool, where: str) -> None:
        """One error naming every problem; ``strict=False`` allows missing and unexpected names."""
        problems = []
        if self.misshaped:
            problems.append(
                "mis-shaped: " + ", ".join(f"{n} (model {list(a)}, file {list(b)})" for n, a, b in self.misshaped)
            )
        if strict and self.missing:
            problems.append("missing from the file: " + ", ".join(self.missing))
        if strict and self.unexpected:
            problems.append("in the file but not the model: " + ", ".join(self.unexpected))
        if problems:
            hint = "" if not strict or self.misshaped else "; strict=False loads the names that match"
            raise ParallelxError(f"loading {where}: " + "; ".join(problems) + hint)


def match_names(model: Mapping[str, tuple[tuple[int, ...], list[str]]], file: WeightFile) -> Matched:
    """Pair each model tensor (key -> (shape, all its names: a tied tensor has several)) with a file's
    tensor by :func:`normal_name`; a tied tensor is found under any of its names."""
    by_normal: dict[str, str] = {}
    for name in file.names():
        by_normal.setdefault(normal_name(name), name)
    pairs: dict[str, str] = {}
    missing: list[str] = []
    misshaped = []
    taken: set[str] = set()
    for key, (shape, names) in model.items():
        hits = [by_normal[n] for n in (normal_name(x) for x in names) if n in by_normal]
        if not hits:
            missing.append(key)
            continue
        taken.update(hits)
        pairs[key] = hits[0]
        if tuple(file.shape(hits[0])) != tuple(shape):
            misshaped.append((key, tuple(shape), tuple(file.shape(hits[0]))))
    unexpected = [n for n in file.names() if n not in taken]
    return Matched(pairs, missing, unexpected, misshaped)
