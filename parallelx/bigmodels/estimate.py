"""How much memory each rank needs, before launching: the model counted on the meta device.

    python -m parallelx estimate benchmarks.memory:gpt_200m --world-sizes 2,4,8
    python -m parallelx estimate path/to/config.json            # a Hugging Face config (or a folder, a hub name)

The model is built under ``torch.device("meta")``: no weight is allocated, so a
70 B-parameter model is counted in a second on a laptop.  What is counted
(:class:`ModelCounts`): each parameter once (a tied weight is one tensor), its
dtype's bytes, the buffers, and the largest block the sharding backends gather
at once (:func:`parallelx.transforms.units.default_units`).

What each backend holds per rank comes from its strategy
(:meth:`parallelx.Strategy.estimate_memory`), which builds its rows with
:func:`layout`: which of parameters, gradients and optimizer state it shards,
what it adds (gradient buckets, flat copies, float32 master partitions), what
set-up costs and what a step allocates for a moment.  This module holds the
arithmetic and the table; it knows no backend.

Not counted: activations (they depend on the batch; ``--activation-checkpointing``
changes them), the allocator's slack, the framework's own start-up
(``import torch`` and the process group: about 0.3-0.5 GiB of RSS a process on
the CPU, a CUDA context on a GPU).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallelx.errors import ParallelxError
from parallelx.transforms.units import default_units

__all__ = [
    "OPTIMIZERS",
    "ModelCounts",
    "RankMemory",
    "Training",
    "build_on_meta",
    "count_model",
    "layout",
    "table",
]

#: Optimizer -> state tensors it keeps per parameter, each the parameter's size and dtype.
OPTIMIZERS: dict[str, int] = {
    "adamw": 2,  # exp_avg, exp_avg_sq (the step counter is one number per tensor)
    "adam": 2,
    "adamw-amsgrad": 3,  # and max_exp_avg_sq
    "adam-amsgrad": 3,
    "sgd": 0,
    "sgd-momentum": 1,  # momentum_buffer
    "adagrad": 1,
    "rmsprop": 1,
}
#: parallelx's precisions (``Options.precision``).
PRECISIONS = ("32", "bf16-mixed", "16-mixed", "bf16-compute")
MiB = 2**20
GiB = 2**30


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelCounts:
    """A model's tensors, counted without allocating them."""

    #: dtype name -> elements, each parameter once (a tied weight is one tensor).
    numel_by_dtype: dict[str, int]
    param_bytes: int
    #: Parameters with ``requires_grad``: what gets gradients and optimizer state.
    trainable_numel: int
    trainable_bytes: int
    #: Buffers, persistent or not (a rotary embedding's ``inv_freq``, BatchNorm's statistics).
    buffer_bytes: int
    #: The largest single parameter (what an optimizer's per-tensor step allocates at once).
    largest_tensor_bytes: int
    largest_tensor_numel: int
    #: The largest block sharded on its own (the bytes fsdp and ZeRO-3 gather whole at once), and what
    #: no block holds (the root's share, gathered for the whole forward and backward).
    largest_unit_bytes: int
    largest_unit_numel: int
    root_bytes: int
    units: int
    tensors: int

    @property
    def numel(self) -> int:
        return sum(self.numel_by_dtype.values())

    @property
    def state_bytes(self) -> int:
        """Parameters and buffers: the size of the model's ``state_dict``, each tensor once."""
        return self.param_bytes + self.buffer_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class Training:
    """What is trained how: the optimizer, the precision, and whether the model is built on the meta device."""

    optimizer: str = "adamw"
    precision: str = "32"
    #: ``eager``: every rank builds the whole model, then sets it up; ``meta``: built on the meta device and
    #: materialised by the backend (each rank its share where the backend shards).
    build: str = "eager"
    #: Ranks that split each block's layers (the counts given are already one rank's share).
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ParallelxError(f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
        if self.precision not in PRECISIONS:
            raise ParallelxError(f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        if self.build not in ("eager", "meta"):
            raise ParallelxError(f"build must be eager or meta, got {self.build!r}")

    @property
    def states(self) -> int:
        return OPTIMIZERS[self.optimizer]

    @property
    def temporaries(self) -> int:
        """Tensors the size of the one being stepped that the optimizer allocates for a moment
        (Adam's ``sqrt(exp_avg_sq) / bias_correction``: two; SGD's in-place updates: none)."""
        return 2 if self.optimizer.startswith("adam") else 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankMemory:
    """One rank's bytes under one backend at one world size."""

    backend: str
    world_size: int
    params: int
    grads: int
    optimizer: int
    buffers: int
    #: What the backend adds: gradient buckets, flat copies, float32 master partitions (``why`` says which).
    extra: int
    #: The peak through set-up (building the model included, as :attr:`Training.build` says).
    setup: int
    #: Allocated for a moment during a step on top of the steady state: gathered blocks, the
    #: optimizer's temporaries (activations not counted).
    transient: int
    why: str = ""

    def with_optimizer(self, nbytes: int) -> RankMemory:
        """This row with the optimizer state's bytes replaced (an engine that keeps it in float32)."""
        return dataclasses.replace(self, optimizer=nbytes)

    @property
    def steady(self) -> int:
        """Held between steps."""
        return self.params + self.grads + self.optimizer + self.buffers + self.extra

    @property
    def peak(self) -> int:
        """The peak through set-up and one step (activations not counted)."""
        return max(self.setup, self.steady + self.transient)


def shard(nbytes: int, world_size: int) -> int:
    """A rank's share of ``nbytes`` split evenly (rounded up, as the shards are padded)."""
    return math.ceil(nbytes / max(1, world_size))


def layout(
    backend: str,
    model: ModelCounts,
    world_size: int,
    training: Training,
    *,
    shards: Iterable[str] = (),
    extra: int = 0,
    why: str = "",
    setup: int | None = None,
    transient: int | None = None,
    param_bytes: int | None = None,
    grad_bytes: int | None = None,
) -> RankMemory:
    """A backend's row: ``shards`` names what it splits over the ranks (``params``, ``grads``,
    ``optimizer``), the rest is whole on every rank.  Gradients and optimizer state take the
    trainable parameters' dtypes (autocast leaves the weights in theirs); ``param_bytes`` and
    ``grad_bytes`` (whole, before sharding) override them where an engine casts the weights.  ``setup`` defaults to the model
    built whole then its part copied out (eager), or each tensor computed whole one at a time and
    its part kept (meta); ``transient`` to the
    optimizer's temporaries for the largest tensor (a per-tensor step, as torch's on the CPU) plus, where parameters are sharded, three
    of the largest block (gathered, the next one prefetched, its gradients before the
    reduce-scatter) and the root's share."""
    sharded = set(shards)
    unknown = sharded - {"params", "grads", "optimizer"}
    if unknown:
        raise ParallelxError(f"layout({backend!r}): unknown shards {sorted(unknown)}")
    n = world_size
    eager = training.build == "eager"

    def split(nbytes: int, what: str) -> int:
        return shard(nbytes, n) if what in sharded else nbytes

    whole_params = model.param_bytes if param_bytes is None else param_bytes
    params = split(whole_params, "params")
    grads = split(model.trainable_bytes if grad_bytes is None else grad_bytes, "grads")
    optimizer = split(training.states * model.trainable_bytes, "optimizer")
    if transient is None:
        transient = training.temporaries * split(model.largest_tensor_bytes, "optimizer")
        if "params" in sharded and n > 1:
            transient += 3 * model.largest_unit_bytes + model.root_bytes
    if setup is None:
        # Meta: each tensor computed whole, one at a time, and this rank's part of it kept.
        split_out = params if "params" in sharded and n > 1 else 0
        setup = model.state_bytes + split_out if eager else params + model.buffer_bytes + model.largest_tensor_bytes
    return RankMemory(
        backend=backend,
        world_size=n,
        params=params,
        grads=grads,
        optimizer=optimizer,
        buffers=model.buffer_bytes,
        extra=extra,
        setup=setup,
        transient=transient,
        why=why,
    )


# ------------------------------------------------------------------ counting
def count_model(model: nn.Module, shares: Mapping[int, int] | None = None) -> ModelCounts:
    """Count ``model``'s parameters and buffers (on any device, meta included: nothing is read).
    ``shares``: how many ranks split a parameter (by ``id``; tensor parallelism): this rank's part counted."""
    params = dict(model.named_parameters())  # remove_duplicate: a tied weight once
    shares = shares or {}

    def numel(t: torch.Tensor) -> int:
        return t.numel() // shares.get(id(t), 1)

    by_dtype: dict[str, int] = {}
    for p in params.values():
        key = str(p.dtype).removeprefix("torch.")
        by_dtype[key] = by_dtype.get(key, 0) + numel(p)

    def nbytes(tensors: Iterable[torch.Tensor]) -> int:
        return sum(numel(t) * t.element_size() for t in tensors)

    trainable = [p for p in params.values() if p.requires_grad]
    units = default_units(model)
    in_units: set[int] = set()
    largest_unit = (0, 0)
    for unit in units:
        own = [p for p in unit.parameters() if id(p) not in in_units]
        in_units.update(id(p) for p in own)
        largest_unit = max(largest_unit, (nbytes(own), sum(numel(p) for p in own)))
    return ModelCounts(
        numel_by_dtype=by_dtype,
        param_bytes=nbytes(params.values()),
        trainable_numel=sum(numel(p) for p in trainable),
        trainable_bytes=nbytes(trainable),
        buffer_bytes=nbytes(dict(model.named_buffers()).values()),
        largest_tensor_bytes=max((nbytes([p]) for p in params.values()), default=0),
        largest_tensor_numel=max((numel(p) for p in params.values()), default=0),
        largest_unit_bytes=largest_unit[0],
        largest_unit_numel=largest_unit[1],
        root_bytes=nbytes(p for p in params.values() if id(p) not in in_units),
        units=len(units),
        tensors=len(params),
    )


# ------------------------------------------------------------ building on meta
def build_on_meta(spec: str) -> tuple[nn.Module, str]:
    """The model ``spec`` names, built on the meta device, and a line saying what it is.

    ``spec``: ``module:function`` or ``path/to/file.py:function`` (a factory called without
    arguments that returns an ``nn.Module``), or a Hugging Face config: a ``config.json``, a
    folder holding one, or a hub name (``transformers`` reads it)."""
    if ":" in spec and not Path(spec).exists():
        where, _, name = spec.rpartition(":")
        factory = _factory(where, name, spec)
        with torch.device("meta"):
            model = factory()
        if not isinstance(model, nn.Module):
            raise ParallelxError(f"{spec} returned a {type(model).__name__}, not a torch.nn.Module")
        return model, f"{spec}() ({type(model).__name__})"
    return _from_hf_config(spec)


def _factory(where: str, name: str, spec: str) -> Callable[[], Any]:
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ParallelxError(f"{spec}: no file {path}")
        loader_spec = importlib.util.spec_from_file_location(path.stem, path)
        assert loader_spec is not None and loader_spec.loader is not None
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules.setdefault(path.stem, module)
        loader_spec.loader.exec_module(module)
    else:
        if str(Path.cwd()) not in sys.path and "" not in sys.path:
            sys.path.insert(0, str(Path.cwd()))  # as `python -m` would: the working folder's packages
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as exc:
            raise ParallelxError(
                f"{spec}: cannot import {where!r} ({exc}); give module:function with the module importable "
                "from this folder, or path/to/file.py:function"
            ) from None
    factory = getattr(module, name, None)
    if factory is None:
        found = sorted(
            n
            for n, v in vars(module).items()
            if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__
        )
        raise ParallelxError(f"{spec}: {where} has no {name!r}; its callables: {', '.join(found[:20]) or 'none'}")
    if not callable(factory):
        raise ParallelxError(f"{spec}: {name} is a {type(factory).__name__}, not a function")
    return factory


def _from_hf_config(spec: str) -> tuple[nn.Module, str]:
    try:
        import transformers
    except ImportError:
        raise ParallelxError(
            f"{spec!r} is not module:function, and reading a Hugging Face config needs transformers: "
            "pip install transformers"
        ) from None
    path = Path(spec)
    if path.suffix == ".json" and not path.is_file():
        raise ParallelxError(f"{spec}: no such file")
    try:
        if path.is_file():
            data = json.loads(path.read_text())
            model_type = data.pop("model_type", None)
            if model_type is None:
                raise ParallelxError(f"{spec}: a Hugging Face config names its model_type; this one does not")
            config = transformers.AutoConfig.for_model(model_type, **data)
        else:
            config = transformers.AutoConfig.from_pretrained(spec)
    except (OSError, ValueError, json.JSONDecodeError) as exc:
        raise ParallelxError(
            f"{spec!r}: neither module:function nor a Hugging Face config transformers can read ({exc})"
        ) from None
    with torch.device("meta"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:  # not a language model: the bare architecture
            model = transformers.AutoModel.from_config(config)
    return model, f"{type(model).__name__} from {spec}"


# ------------------------------------------------------------------ the table
def human(nbytes: int) -> str:
    if nbytes >= 10 * GiB:
        return f"{nbytes / GiB:.0f} GiB"
    if nbytes >= GiB:
        return f"{nbytes / GiB:.1f} GiB"
    return f"{nbytes / MiB:.0f} MiB" if nbytes >= MiB else f"{nbytes / 1024:.0f} KiB"


def describe(model: ModelCounts, what: str) -> str:
    dtypes = ", ".join(f"{n / 1e6:,.1f} M {d}" for d, n in sorted(model.numel_by_dtype.items()))
    return (
        f"{what}: {model.numel / 1e6:,.1f} M parameters ({dtypes}; {model.tensors} tensors, "
        f"{model.trainable_numel / 1e6:,.1f} M trained), {human(model.param_bytes)} of weights, "
        f"{human(model.buffer_bytes)} of buffers; {model.units} blocks sharded on their own, the largest "
        f"{human(model.largest_unit_bytes)}, the root's share {human(model.root_bytes)}"
    )


def table(rows: Sequence[RankMemory]) -> str:
    """A Markdown table of the rows, per rank."""
    lines = [
        "| backend | processes | params | grads | optimizer | buffers | backend adds | held | set-up peak | peak |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        adds = human(r.extra) + (f" ({r.why})" if r.why else "") if r.extra else "-"
        lines.append(
            f"| {r.backend} | {r.world_size} | {human(r.params)} | {human(r.grads)} | {human(r.optimizer)} | "
            f"{human(r.buffers)} | {adds} | {human(r.steady)} | {human(r.setup)} | {human(r.peak)} |"
        )
    return "\n".join(lines) + "\n"
