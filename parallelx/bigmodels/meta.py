"""Models built without their weights, given them later exactly as an eager build would have.

    with parallelx.init_module():            # the meta device, and a record of how each tensor was made
        model = GPT(config)                   # no memory; the random numbers are drawn (and dropped) as eagerly
    model, optimizer = backend.setup(model, optimizer)   # each rank computes the tensors it keeps

On the meta device nothing is computed, so nothing of the weights survives
the build: neither the random numbers the modules' initialisation drew nor a
rotary embedding's ``inv_freq`` made in ``__init__``.  :func:`init_module`
therefore records, in order, every call that makes or changes a meta tensor
(a torch function mode), and for each call that draws random numbers it
keeps the generator's state before the draw and then makes the same draw
into a scratch tensor of the same layout, so that the generator leaves the
build where an eager build leaves it (and the script's later random numbers,
its dropout and its shuffling, are the eager ones too).

:meth:`Recording.values` later replays only the calls a tensor depends on,
on real tensors, each random one from its saved state: the result is the
eager tensor bit for bit, one tensor (or one unit) at a time, in any order,
so that a sharding backend can compute each tensor, keep its slice and drop
the rest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._pytree import tree_flatten, tree_map

from parallelx import log
from parallelx.bigmodels.resets import constructor_runs, reset_name
from parallelx.errors import ParallelxError

__all__ = [
    "Cut",
    "Recording",
    "cut",
    "has_meta",
    "init_module",
    "init_weights",
    "materialize",
    "meta_tensors",
    "recording_of",
]


#: Calls that draw from a random generator (torch's functions, tensor methods and ``nn.init``'s).
RANDOM = frozenset(
    {
        "uniform_",
        "normal_",
        "random_",
        "bernoulli_",
        "exponential_",
        "cauchy_",
        "log_normal_",
        "geometric_",
        "trunc_normal_",
        "xavier_uniform_",
        "xavier_normal_",
        "kaiming_uniform_",
        "kaiming_normal_",
        "orthogonal_",
        "sparse_",
        "rand",
        "randn",
        "randint",
        "randperm",
        "rand_like",
        "randn_like",
        "randint_like",
        "bernoulli",
        "normal",
        "multinomial",
        "poisson",
    }
)

#: Factories that take only the layout (shape, dtype) of the tensor they are given, never its values:
#: replaying one needs no value of that tensor (an output layer given ``torch.empty_like(old)`` and
#: then drawn anew must not make the old, replaced weight be computed beside it).
LAYOUT_ONLY = frozenset(
    {
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "rand_like",
        "randn_like",
        "randint_like",
        "new_empty",
        "new_zeros",
        "new_ones",
        "new_full",
        "new_empty_strided",
    }
)

#: In-place by name, but they change no value.
NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad_", "pin_memory_"})

#: The attribute a module built under :func:`init_module` carries: the recording of its tensors.
ATTRIBUTE = "_parallelx_recording"


def _key(t: torch.Tensor) -> StorageWeakRef:
    # Equal for tensors that share one storage (a parameter made from a tensor, views of it).
    return StorageWeakRef(t.untyped_storage())


def _is_meta(x: object) -> bool:
    return isinstance(x, torch.Tensor) and x.is_meta


def _metas(tree: object) -> list[torch.Tensor]:
    flat, _ = tree_flatten(tree)
    return [t for t in flat if _is_meta(t)]


def _alias(x: Any) -> Any:
    return x.detach() if _is_meta(x) else x


def _mutated(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The tensor an in-place call writes (``t.uniform_()``, ``nn.init.normal_(tensor=t)``, ``t[i] = v``)."""
    if name in NOT_WRITES or (not (name.endswith("_") and not name.startswith("__")) and name != "__setitem__"):
        return None
    first = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
    return first if _is_meta(first) else None


@dataclasses.dataclass
class Event:
    """One recorded call that made or changed a meta tensor."""

    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out: Any
    #: Storages this call made (its new outputs) or changed (in place).
    writes: frozenset[StorageWeakRef]
    #: Storages of the meta tensors it read.
    reads: frozenset[StorageWeakRef]
    #: A factory (``torch.empty``, ``torch.randn``): replayed on the build's device.
    factory: bool
    #: A :data:`LAYOUT_ONLY` factory: its first argument stays on the meta device when replayed.
    template: bool = False
    #: For a call that draws random numbers: the generator and its state before the draw.
    generator: torch.Generator | None = None
    state: torch.Tensor | None = None


class Recording(TorchFunctionMode):
    """How every meta tensor of a build was made (see the module's docstring); one per :func:`init_module` block."""

    def __init__(self, device: torch.device, *, draw: bool = True) -> None:
        super().__init__()
        #: The device an eager build would have used (the default device outside the block).
        self.device = device
        #: False for a dry run that only learns which tensors calls write: no draw, no generator moved.
        self.draw = draw
        self.events: list[Event] = []
        #: Storage -> the event that made it.
        self.made: dict[StorageWeakRef, Event] = {}
        self._constructors = _device_constructors()
        #: The bytes every draw of the block is made into (:meth:`_scratch`), while the block lasts.
        self._spare: torch.Tensor | None = None

    # ------------------------------------------------------------ recording
    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        target = _mutated(name, args, kwargs)
        # A draw in place into a meta tensor changes nothing on meta, and torch's meta `normal_` (and
        # the inits built on it) imports torch._dynamo and sympy, 150 MiB a process, for nothing (a
        # torch optimizer's constructor imports the same; a model only evaluated is spared it).  The
        # draw itself is made below, on a scratch tensor, which checks its arguments as eager would.
        out = target if target is not None and name in RANDOM else func(*args, **kwargs)
        ins = _metas((args, kwargs))
        outs = _metas(out)
        in_keys = {_key(t) for t in ins}
        made = {_key(t) for t in outs} - in_keys
        layout = name in LAYOUT_ONLY and bool(args) and _is_meta(args[0])
        if layout:
            in_keys.discard(_key(args[0]))
        if not made and target is None:
            return out  # a read (a size, a view): nothing to replay
        event = Event(
            func=func,
            # Aliases, not the tensors: a parameter given its value later (torch.utils.swap_tensors) must
            # not turn the record of how it was made into calls on the real tensor.
            args=tuple(tree_map(_alias, tuple(args))),
            kwargs=tree_map(_alias, kwargs),
            out=tree_map(_alias, out),
            writes=frozenset(made | ({_key(target)} if target is not None else set())),
            reads=frozenset(in_keys),
            factory=func in self._constructors or not ins or layout,
            template=layout,
        )
        if name in RANDOM and self.draw:
            # The eager draw, made now into a scratch tensor of the same layout and dropped: the
            # generator moves as an eager build moves it, and its state before is kept for the replay.
            generator = kwargs.get("generator") or self._default_generator()
            event.generator, event.state = generator, generator.get_state()
            with torch.no_grad():
                self._run(event, self._scratch)
        self.events.append(event)
        for k in made:
            self.made.setdefault(k, event)
        return out

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        self._spare = None  # the draws' buffer lives as long as the block
        super().__exit__(exc_type, exc_value, traceback)

    def _default_generator(self) -> torch.Generator:
        if self.device.type == "cuda":
            return torch.cuda.default_generators[self.device.index or torch.cuda.current_device()]
        return torch.default_generator

    def _scratch(self, t: torch.Tensor) -> torch.Tensor:
        # One buffer for all the block's draws, grown to the largest, not a tensor per draw: each of those,
        # freed at once, left a hole in glibc's heap that the small allocations made between two draws
        # split, so the next draw took fresh memory; a 771 MiB GPT built under init_module held 1.27 GiB
        # of RSS after its build (docs/big-models.md, "Measured").  The draw itself is the same: same
        # shape, strides and dtype, so the generator moves as it does eagerly.
        nbytes = t.untyped_storage().nbytes()
        if self._spare is None or self._spare.numel() < nbytes:
            self._spare = None  # freed before the larger one is made
            self._spare = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._like(t, self._spare[:nbytes].view(t.dtype))

    def _like(self, t: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """A real tensor laid out in ``base``'s storage as ``t`` is in its own (a view of ``base``)."""
        if base.dtype != t.dtype:
            raise ParallelxError(
                f"init_module: a tensor is read as {t.dtype} from storage made as {base.dtype} (a view that "
                "changes the dtype); build this model eagerly, or change the view outside the model's __init__"
            )
        base = base.to(self.device) if base.device != self.device else base
        if (
            tuple(t.shape) == tuple(base.shape)
            and t.stride() == base.stride()
            and t.storage_offset() == base.storage_offset()
        ):
            return base
        return torch.as_strided(base, t.shape, t.stride(), t.storage_offset())

    def _run(self, event: Event, real: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        def swap(x: Any) -> Any:
            return real(x) if _is_meta(x) else x

        kept = 1 if event.template else 0  # a layout-only factory's template stays on meta
        args = (*event.args[:kept], *tree_map(swap, event.args[kept:]))
        kwargs = tree_map(swap, event.kwargs)
        if event.factory:
            device = kwargs.get("device")
            if device is None or torch.device(device).type == "meta":
                kwargs["device"] = self.device
        return event.func(*args, **kwargs)

    # ------------------------------------------------------------ replaying
    def knows(self, t: torch.Tensor) -> bool:
        return _key(t) in self.made

    def values(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The real values of meta tensors of this build, as the eager build made them (on the build's
        device): only the calls they depend on are replayed, each random one from its saved state.
        The random generators are left where they were."""
        keys = {_key(t) for t in tensors}
        unknown = [t for t in tensors if _key(t) not in self.made]
        if unknown:
            raise ParallelxError(
                f"init_module: {len(unknown)} meta tensor(s) (shapes {[tuple(t.shape) for t in unknown[:3]]}) were "
                "not made inside the parallelx.init_module() block that built the rest of this model; build "
                "the whole model inside it"
            )
        needed = set(keys)
        chosen: list[Event] = []
        for event in reversed(self.events):
            if event.writes & needed:
                chosen.append(event)
                needed |= event.reads
        bases: dict[StorageWeakRef, torch.Tensor] = {}

        def real(t: torch.Tensor) -> torch.Tensor:
            base = bases.get(_key(t))
            if base is None:
                raise ParallelxError(
                    f"init_module: a meta tensor of shape {tuple(t.shape)} is read before anything made it "
                    "(it was made outside the parallelx.init_module() block); build the whole model inside it"
                )
            return self._like(t, base)

        generators = {id(e.generator): e.generator for e in chosen if e.generator is not None}
        saved = {i: g.get_state() for i, g in generators.items()}
        try:
            with torch.no_grad():
                for event in reversed(chosen):
                    if event.generator is not None and event.state is not None:
                        event.generator.set_state(event.state)
                    result = self._run(event, real)
                    metas, _ = tree_flatten(event.out)
                    reals, _ = tree_flatten(result)
                    for m, r in zip(metas, reals, strict=False):
                        if _is_meta(m) and isinstance(r, torch.Tensor):
                            k = _key(m)
                            if k in event.writes and k not in bases:
                                # The storage's first maker: real storage laid out as the meta one.
                                bases[k] = torch.as_strided(
                                    r, (r.untyped_storage().nbytes() // r.element_size(),), (1,), 0
                                )
        finally:
            for i, g in generators.items():
                g.set_state(saved[i])
        out = []
        for t in tensors:
            value = real(t)
            whole = value.untyped_storage().nbytes() == value.numel() * value.element_size()
            out.append(value if whole and value.is_contiguous() else value.clone())
        return out


_live: list[Recording] = []


def _tag(module: nn.Module, name: str, value: Any) -> None:
    # A module given a meta tensor inside the block carries the block's recording.
    if _live and isinstance(value, torch.Tensor) and value.is_meta:
        module.__dict__[ATTRIBUTE] = _live[-1]


@contextlib.contextmanager
def init_module() -> Iterator[Recording]:
    """Build a model without allocating its weights: modules made inside live on the meta device,
    and every backend's ``setup`` computes the tensors each rank keeps, equal bit for bit to the same
    model built eagerly from the same random state (see docs/big-models.md for what that covers).

    ::

        torch.manual_seed(0)
        with parallelx.init_module():
            model = GPT(config)           # nn.init, model.apply(_init_weights), rotary buffers, tied weights
        model, optimizer = backend.setup(model, torch.optim.AdamW(model.parameters()))
    """
    recording = Recording(torch.get_default_device())
    hooks = [
        register_module_parameter_registration_hook(_tag),
        register_module_buffer_registration_hook(_tag),
    ]
    _live.append(recording)
    try:
        with torch.device("meta"), _recording(recording), _libraries_initialise():
            yield recording
    finally:
        _live.remove(recording)
        for h in hooks:
            h.remove()


@contextlib.contextmanager
def _recording(recording: Recording) -> Iterator[None]:
    """``recording`` active, with the ``nn.init`` functions that skip meta tensors recorded too."""
    originals = {name: getattr(nn.init, name) for name in SILENT_ON_META}
    for name, original in originals.items():
        setattr(nn.init, name, _recorded(recording, original))
    try:
        with recording:
            yield
    finally:
        for name, original in originals.items():
            setattr(nn.init, name, original)


@contextlib.contextmanager
def _libraries_initialise() -> Iterator[None]:
    """Libraries that skip their weight initialisation when they see the meta device run it here,
    as the eager build does: ``transformers`` asks ``torch.tensor([]).device`` and, finding meta,
    leaves every ``_init_weights`` out (its models would get ``nn.Linear``'s defaults instead of their
    own, and the random generator would end elsewhere).  The recording makes their draws cost nothing."""
    utils = sys.modules.get("transformers.modeling_utils")
    probe = getattr(utils, "get_torch_context_manager_or_global_device", None)
    if probe is None:
        yield
        return

    def not_meta() -> Any:
        found = probe()
        return None if found is not None and torch.device(found).type == "meta" else found

    utils.get_torch_context_manager_or_global_device = not_meta  # type: ignore[union-attr]
    try:
        yield
    finally:
        utils.get_torch_context_manager_or_global_device = probe  # type: ignore[union-attr]


#: ``nn.init`` functions that return at once for a meta tensor, before any torch function a mode sees:
#: inside :func:`init_module` they are recorded as one call each (as ``nn.init.trunc_normal_``,
#: looked up on the module when called; a name imported from ``torch.nn.init`` beforehand is not).
SILENT_ON_META = ("trunc_normal_", "orthogonal_", "sparse_", "dirac_")


def _recorded(recording: Recording, original: Callable[..., Any]) -> Callable[..., Any]:
    def init(*args: Any, **kwargs: Any) -> Any:
        target = args[0] if args else kwargs.get("tensor")
        if _is_meta(target):
            return recording.__torch_function__(original, (), args, kwargs)
        return original(*args, **kwargs)

    init.__name__ = original.__name__
    init.__doc__ = original.__doc__
    return init


def recording_of(module: nn.Module) -> Recording | None:
    """The recording of a module built under :func:`init_module` (None for one built otherwise)."""
    rec = module.__dict__.get(ATTRIBUTE)
    return rec if isinstance(rec, Recording) else None


@dataclasses.dataclass
class Slot:
    """One tensor of a model (a parameter or buffer, once however often it is tied) and where it sits."""

    tensor: torch.Tensor
    owners: list[tuple[nn.Module, str]]
    is_param: bool
    names: list[str]
    #: The meta tensor itself (``tensor`` becomes the real one once :func:`put` gives it its value).
    meta: torch.Tensor | None = None


def model_tensors(model: nn.Module, *, only_meta: bool = True) -> list[Slot]:
    """The model's parameters and buffers (by default its meta ones), each once (tied ones with all
    their places), in order."""
    slots: dict[int, Slot] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        tables = (
            ("param", module.named_parameters(recurse=False, remove_duplicate=False)),
            ("buffer", module.named_buffers(recurse=False, remove_duplicate=False)),
        )
        for kind, table in tables:
            for name, t in table:
                if only_meta and not t.is_meta:
                    continue
                full = f"{prefix}.{name}" if prefix else name
                slot = slots.get(id(t))
                if slot is None:
                    slots[id(t)] = Slot(t, [(module, name)], kind == "param", [full], t.detach() if t.is_meta else None)
                elif (module, name) not in [(m, n) for m, n in slot.owners]:
                    slot.owners.append((module, name))
                    slot.names.append(full)
    return list(slots.values())


def meta_tensors(model: nn.Module) -> list[Slot]:
    """The model's meta parameters and buffers (:func:`model_tensors`)."""
    return model_tensors(model)


def has_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


class Source(Protocol):
    """Where a meta tensor's value comes from besides its recording: a weight file (``pretrained.py``)."""

    def holds(self, slot: Slot) -> bool:
        """Whether this source has the slot's value."""

    def rows(
        self, slot: Slot, start: int | None, stop: int | None, columns: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """Rows ``start:stop`` (dim 0) of the slot's value as stored (only ``columns`` of them, if given)."""


#: The attribute of a model given a weight file before set-up (:func:`parallelx.load_pretrained`).
SOURCE = "_parallelx_weights"


class _Sources:
    """The weight files given to a model's modules (``load_pretrained`` on the model, or on a module
    of it such as a wrapper's inner model), as one source: a tensor from the first that holds it."""

    def __init__(self, sources: list[Source]) -> None:
        self.sources = sources

    def holds(self, slot: Slot) -> bool:
        return any(s.holds(slot) for s in self.sources)

    def rows(
        self, slot: Slot, start: int | None, stop: int | None, columns: tuple[int, int] | None = None
    ) -> torch.Tensor:
        return next(s for s in self.sources if s.holds(slot)).rows(slot, start, stop, columns)


def source_of(model: nn.Module) -> Source | None:
    """Where ``model``'s meta tensors' values come from besides their recordings: the weight files
    given to it or to any module inside it (:func:`parallelx.load_pretrained`)."""
    found = [m.__dict__[SOURCE] for m in model.modules() if SOURCE in m.__dict__]
    return None if not found else found[0] if len(found) == 1 else _Sources(found)


#: The attribute of a model given an init function by :func:`init_weights`.
INIT = "_parallelx_init"

#: The attribute of a meta model whose tensors were cut to one rank's slices before they had values
#: (tensor parallelism, :func:`cut`): id of the tensor -> :class:`Cut`.
CUTS = "_parallelx_cuts"


@dataclasses.dataclass(frozen=True)
class Cut:
    """A meta tensor that holds one rank's slice of a whole one: along ``dim``, in ``parts`` fused
    parts, each cut in ``size`` equal chunks of which this rank keeps chunk ``rank``.  ``whole`` is
    the meta tensor as built (what its recording and a weight file know)."""

    whole: torch.Tensor
    dim: int
    parts: int
    rank: int
    size: int

    def ranges(self, start: int, stop: int) -> list[tuple[int, int]]:
        """The whole tensor's index ranges along ``dim`` that hold the slice's ``start:stop``."""
        part = self.whole.shape[self.dim] // self.parts
        chunk = part // self.size
        out = []
        for k in range(self.parts):  # the slice is the parts' chunks one after another
            lo, hi = max(start, k * chunk), min(stop, (k + 1) * chunk)
            if lo < hi:
                base = k * part + self.rank * chunk - k * chunk
                out.append((base + lo, base + hi))
        return out

    def read(
        self,
        whole_rows: Callable[[int, int, tuple[int, int] | None], torch.Tensor],
        start: int | None,
        stop: int | None,
    ) -> torch.Tensor:
        """Rows ``start:stop`` of the slice, from ``whole_rows(first, last, columns)`` of the whole."""
        local = list(self.whole.shape)
        local[self.dim] //= self.size
        start, stop, _ = slice(start, stop).indices(local[0])
        if self.dim == 0:
            pieces = [whole_rows(a, b, None) for a, b in self.ranges(start, stop)]
            return torch.cat(pieces) if len(pieces) != 1 else pieces[0]
        assert self.dim == 1, "tensors are cut along their rows or their columns"
        pieces = [whole_rows(start, stop, cols) for cols in self.ranges(0, local[1])]
        return torch.cat(pieces, dim=1) if len(pieces) != 1 else pieces[0]


def cut(model: nn.Module, tensor: torch.Tensor, dim: int, parts: int, rank: int, size: int) -> torch.Tensor:
    """Cut ``model``'s meta ``tensor`` (a parameter: it stays the same object) to rank ``rank``'s slice
    (:class:`Cut`) before it has a value: its value is computed, or read from a weight file, for that
    slice only when the backend materialises the model."""
    assert tensor.is_meta
    whole = tensor.detach()
    spec = Cut(whole, dim, parts, rank, size)
    local = list(whole.shape)
    local[dim] //= size
    tensor.data = torch.empty(local, dtype=whole.dtype, device="meta")
    model.__dict__.setdefault(CUTS, {})[id(tensor)] = spec
    return tensor


#: In-place calls that give a whole tensor its value whatever it held before: the first write to a
#: tensor of a plain ``torch.device("meta")`` build must be one of them (anything else would read
#: memory nobody wrote).
OVERWRITES = frozenset(
    {n for n in RANDOM if n.endswith("_")}
    | {"fill_", "zero_", "copy_", "constant_", "ones_", "zeros_", "eye_", "dirac_"}
)


def init_weights(model: nn.Module, init: Callable[[nn.Module], None]) -> nn.Module:
    """Give ``model`` its initialisation beyond its modules' ``reset_parameters``: ``init(model)``.

    For a model built under plain ``torch.device("meta")``, ``backend.setup`` computes each tensor
    as the modules' ``reset_parameters()`` that the eager build ran (children first, as their
    constructors ran them) and then ``init(model)`` make it, one tensor at a time, each rank
    keeping its share: the eager build's values bit for bit when the model's ``__init__`` did
    exactly that from the same random state.
    For a model that already has its weights, ``init(model)`` runs now.  Returns the model::

        with torch.device("meta"):
            model = GPT(config)                 # its __init__ ends with self.init_weights()
        parallelx.init_weights(model, GPT.init_weights)
        model, optimizer = backend.setup(model, optimizer)
    """
    if not has_meta(model):
        with torch.no_grad():
            init(model)
        return model
    model.__dict__[INIT] = init
    return model


def _post_order(module: nn.Module, seen: set[int]) -> Iterator[nn.Module]:
    for child in module.children():
        if id(child) not in seen:
            seen.add(id(child))
            yield from _post_order(child, seen)
    yield module


def _whole(t: torch.Tensor) -> bool:
    return bool(
        t.is_contiguous() and t.storage_offset() == 0 and t.numel() * t.element_size() == t.untyped_storage().nbytes()
    )


@dataclasses.dataclass
class _Reset:
    """One module's reset, and what a dry run on the meta tensors saw it do."""

    module: nn.Module
    call: Callable[[], Any]
    #: ``Class.reset_parameters`` (for messages).
    name: str
    #: Whether the module's constructor calls it (:func:`~parallelx.bigmodels.resets.constructor_runs`).
    eager: bool | None
    writes: frozenset[StorageWeakRef] = frozenset()
    draws: bool = False


def _dry_writes(run: Callable[[], Any], keys: set[StorageWeakRef]) -> tuple[frozenset[StorageWeakRef], bool]:
    """Which of ``keys`` ``run()`` writes, and whether it draws random numbers: run on the meta
    tensors with nothing drawn (the generator stays where it is)."""
    dry = Recording(torch.get_default_device(), draw=False)
    with _recording(dry), torch.no_grad():
        run()
    writes = frozenset(k for e in dry.events for k in e.writes if k in keys)
    return writes, any(getattr(e.func, "__name__", "") in RANDOM for e in dry.events)


def _listed(names: Sequence[str], most: int = 6) -> str:
    return ", ".join(names[:most]) + (f" ... ({len(names)} in all)" if len(names) > most else "")


def _plan_resets(model: nn.Module, roots: dict[StorageWeakRef, Slot], who: str) -> tuple[list[_Reset], list[str]]:
    """The resets to replay, in post-order: those the eager build ran, as its constructors ran them.

    Every layer of ``torch.nn`` calls its reset in ``__init__``, so after its children's (post-order
    is construction order); a composite reset that re-runs its children's (PyTorch's FSDP2 example)
    is called by no constructor, and replayed on top of them it would re-draw their tensors.  Such a
    reset is left out when the resets the eager build ran (or the function given to
    :func:`init_weights`) set every tensor it sets; where something only it sets, it is replayed for
    that, and where the source cannot tell, it is replayed as before; both are warned of, naming the
    tensors that then differ from the eager build.  Returns the resets and the names of those left out."""
    resets = []
    for module in _post_order(model, set()):
        name = reset_name(module)
        if name is not None:
            cls = type(module)
            resets.append(_Reset(module, getattr(module, name), f"{cls.__name__}.{name}", constructor_runs(cls, name)))
    if all(r.eager for r in resets):
        return resets, []  # every constructor ran its own (torch.nn's layers): no dry run needed
    keys = set(roots)
    for r in resets:
        r.writes, r.draws = _dry_writes(r.call, keys)
    covered = frozenset().union(*(r.writes for r in resets if r.eager is not False))
    init = model.__dict__.get(INIT)
    by_init: frozenset[StorageWeakRef] | None = None
    chosen: list[_Reset] = []
    left_out: list[str] = []
    for r in resets:
        if r.eager is False:
            alone = r.writes - covered
            if alone and init is not None:
                if by_init is None:
                    by_init = _dry_writes(lambda: init(model), keys)[0]
                alone -= by_init
            if not alone:
                left_out.append(r.name)  # the eager build never ran it, and what it sets is set otherwise
                continue
            _warn_replayed(r, resets, alone, roots, who)
            covered |= r.writes
        elif r.eager is None:
            _warn_replayed(r, resets, frozenset(), roots, who)
        chosen.append(r)
    return chosen, left_out


def _warn_replayed(
    r: _Reset, resets: Sequence[_Reset], alone: frozenset[StorageWeakRef], roots: dict[StorageWeakRef, Slot], who: str
) -> None:
    """Warn of a reset replayed although its constructor does not call it (``alone``: the tensors only
    it sets), or although its constructor could not be read: name the tensors that then differ."""
    inner = {id(m) for m in r.module.modules()} - {id(r.module)}
    theirs = frozenset().union(*(o.writes for o in resets if id(o.module) in inner and o.eager is not False))
    again = [roots[k].names[0] for k in roots if k in r.writes & theirs]
    cls = type(r.module).__name__
    fix = (
        "build the model under `with parallelx.init_module():` for the eager build's values (it records what "
        "__init__ does), or build it eagerly"
    )
    if r.eager is None:
        if again:
            log.warn(
                f"{who}: {r.name}() sets tensors that its children's own resets set ({_listed(again)}), and the "
                f"source of {cls}.__init__ cannot be read to tell whether the eager build ran it: it is replayed "
                f"after its children's, as by an __init__ that ends with it; if the eager build never ran it, "
                f"those tensors differ from the eager build's; {fix}"
            )
        return
    if not again and not r.draws:
        return  # a deterministic reset of tensors nothing else sets (an RMSNorm's ones_): as __init__ made them
    own = [roots[k].names[0] for k in roots if k in alone]
    log.warn(
        f"{who}: {cls}.__init__ does not call {r.name}() (the eager build never ran it), but nothing else sets "
        f"{_listed(own)}: it is replayed for them, so they take its values, not those __init__ made (lost on "
        "the meta device)"
        + (f"; it also re-initialises {_listed(again)}, which its children's resets set" if again else "")
        + ("; its random draws move the generator where the eager build's did not" if r.draws else "")
        + f": these differ from the eager build; {fix}"
    )


def record_reset(model: nn.Module, slots: Sequence[Slot], who: str) -> tuple[Recording, list[str]]:
    """A recording of how the plain-meta ``slots`` of ``model`` get their values: the modules'
    ``reset_parameters()`` (or torch's private ``_reset_parameters``) that the eager build ran, in
    post-order (:func:`_plan_resets`), then the function given to :func:`init_weights`, run now on
    the meta tensors with each random draw made into a scratch tensor (so the generator moves as the
    eager build moved it).  A tensor these do not overwrite whole is refused, naming it.  Returns the
    recording and the resets left out."""
    recording = Recording(torch.get_default_device())
    roots: dict[StorageWeakRef, Slot] = {}
    for slot in slots:
        assert slot.meta is not None
        key = _key(slot.meta)
        if key in roots:
            continue
        size = slot.meta.untyped_storage().nbytes() // slot.meta.element_size()
        # The storage comes into being empty: what fills it is recorded below.
        event = Event(
            func=torch.empty,
            args=((size,),),
            kwargs={"dtype": slot.meta.dtype},
            out=torch.as_strided(slot.meta, (size,), (1,), 0),
            writes=frozenset({key}),
            reads=frozenset(),
            factory=True,
        )
        recording.events.append(event)
        recording.made[key] = event
        roots[key] = slot
    done = len(recording.events)
    init = model.__dict__.get(INIT)
    resets, left_out = _plan_resets(model, roots, who)
    with _recording(recording), torch.no_grad():
        for r in resets:
            r.call()
        if init is not None:
            init(model)
    first_write: dict[StorageWeakRef, Event] = {}
    for event in recording.events[done:]:
        for key in event.writes:
            first_write.setdefault(key, event)
    unset = []
    for key, slot in roots.items():
        written = first_write.get(key)
        name = getattr(written.func, "__name__", "") if written is not None else ""
        target = _mutated(name, written.args, written.kwargs) if written is not None else None
        if name not in OVERWRITES or target is None or not _whole(target):
            unset.append(slot.names[0])
    if unset:
        raise ParallelxError(
            f"{who}: the model was built under torch.device('meta'), where the values its __init__ made are "
            f"lost, and no module's reset_parameters() (nor the function given to parallelx.init_weights) sets "
            f"{', '.join(unset[:6])}{' ...' if len(unset) > 6 else ''}; build the model under "
            "`with parallelx.init_module():` instead (it records everything __init__ does: factories such as "
            "torch.ones, rotary buffers, custom inits), or give their initialisation with "
            "parallelx.init_weights(model, fn), or load them with parallelx.load_pretrained"
        )
    for slot in roots.values():
        for module, _ in slot.owners:
            module.__dict__[ATTRIBUTE] = recording
    return recording, left_out


def prepare(model: nn.Module, who: str) -> None:
    """Make sure every meta tensor of ``model`` has a source of values: a plain ``torch.device("meta")``
    build (no recording, tensors the weight file does not give) is given its modules'
    ``reset_parameters`` and :func:`init_weights` now (:func:`record_reset`): their random draws move
    the generator here, as the eager build's moved it there.  Does nothing for other models."""
    if any(recording_of(m) is not None for m in model.modules()):
        return  # built under init_module (or prepared already): its recording gives the values
    source = source_of(model)
    plain = [s for s in meta_tensors(model) if not (source is not None and source.holds(s))]
    if not plain:
        return
    _, left_out = record_reset(model, plain, who)
    named = ", ".join(s.names[0] for s in plain[:3]) + (" ..." if len(plain) > 3 else "")
    counts = Counter(left_out)
    log.info(
        f"{who}: the model was built under torch.device('meta'): its {len(plain)} tensors ({named}) get their "
        "values from their modules' reset_parameters()"
        + (" and the function given to parallelx.init_weights" if INIT in model.__dict__ else "")
        + " (parallelx.init_module() records what __init__ does instead)"
        + (
            "; not replayed, as no constructor calls them (the eager build ran only the resets they repeat): "
            + ", ".join(f"{n}{f' x{c}' if c > 1 else ''}" for n, c in counts.items())
            if counts
            else ""
        )
    )


class Values:
    """The real value of each meta tensor of a model, one tensor or one slice at a time: from the
    weight file it was given (:func:`parallelx.load_pretrained`), else from its recording, else
    (a plain ``torch.device("meta")`` build) from its modules' ``reset_parameters`` and
    :func:`init_weights`.  A model with a meta tensor that none gives is refused here, before
    anything is changed."""

    def __init__(self, model: nn.Module, who: str) -> None:
        self.slots = meta_tensors(model)
        self.by_name = {n: s for s in self.slots for n in s.names}
        source = source_of(model)
        self.source: Source | None = source
        prepare(model, who)
        self.recordings: dict[int, Recording] = {}
        self.from_file: set[int] = set()
        cuts: dict[int, Cut] = model.__dict__.get(CUTS, {})
        self.cuts = {id(s): cuts[id(s.tensor)] for s in self.slots if id(s.tensor) in cuts}
        orphans = []
        for slot in self.slots:
            if source is not None and source.holds(slot):
                self.from_file.add(id(slot))
                continue
            built = self.cuts[id(slot)].whole if id(slot) in self.cuts else slot.tensor  # what the recording saw
            rec = next((r for m, _ in slot.owners if (r := recording_of(m)) is not None and r.knows(built)), None)
            if rec is None:
                orphans.append(slot.names[0])
            else:
                self.recordings[id(slot)] = rec
        if orphans:
            raise ParallelxError(
                f"{who}: the model's {', '.join(orphans[:4])}{' ...' if len(orphans) > 4 else ''} are on the meta "
                "device with nothing to compute them from (built under torch.device('meta'), where the values an "
                "eager build makes are lost, and not in the weights given to parallelx.load_pretrained); build the "
                "model under `with parallelx.init_module():` instead, which records how each tensor is made, or "
                "build it eagerly"
            )

    def slot(self, name: str) -> Slot | None:
        return self.by_name.get(name)

    def rows(self, slot: Slot, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Rows ``start:stop`` (dim 0) of the slot's value, in its dtype; a file reads only those."""
        assert slot.meta is not None
        spec = self.cuts.get(id(slot))
        if id(slot) in self.from_file:
            source = self.source
            assert source is not None
            if spec is not None:  # one rank's slice: a file reads only its rows, or its rows' columns
                return spec.read(lambda a, b, cols: source.rows(slot, a, b, cols), start, stop).to(slot.meta.dtype)
            return source.rows(slot, start, stop).to(slot.meta.dtype)
        whole = self.recordings[id(slot)].values([slot.meta if spec is None else spec.whole])[0]
        if spec is not None:  # computed whole (a recording replays whole tensors), the slice kept
            return spec.read(lambda a, b, cols: whole[a:b, slice(*cols)] if cols else whole[a:b], start, stop).clone()
        return whole if start is None and stop is None else whole[start:stop]

    def whole(self, slot: Slot) -> torch.Tensor:
        return self.rows(slot)

    def flat(self, slot: Slot, start: int, stop: int) -> torch.Tensor:
        """Elements ``start:stop`` of the slot's value flattened (the rows that hold them, then cut)."""
        assert slot.meta is not None
        shape = tuple(slot.meta.shape)
        if not shape:
            return self.whole(slot).reshape(1)[start:stop]
        row = max(1, slot.meta[0].numel()) if shape[0] else 1
        first, last = start // row, -(-stop // row)
        return self.rows(slot, first, last).reshape(-1)[start - first * row : stop - first * row]


def put(slot: Slot, value: torch.Tensor) -> torch.Tensor:
    """Give a meta parameter or buffer its real value in place and return it: a parameter keeps its
    identity (an optimizer built on it before set-up still holds it), tied places stay one tensor."""
    if slot.is_param:
        param = slot.tensor
        new = nn.Parameter(value, requires_grad=param.requires_grad)
        new.__dict__.update(param.__dict__)  # marks set on the meta parameter (a split layer's) stay with it
        try:
            torch.utils.swap_tensors(param, new)
        except RuntimeError:  # weakly referenced: the owners get the new parameter instead
            param = new
        assert isinstance(param, nn.Parameter)
        for module, name in slot.owners:
            setattr(module, name, param)
        return param
    for module, name in slot.owners:
        setattr(module, name, value)  # still a buffer, persistent or not as it was
    return value


def materialize(model: nn.Module, device: torch.device | str | None = None, *, who: str = "materialize") -> None:
    """Give every meta tensor of ``model`` its value, in place, one tensor at a time, on ``device``
    (default: the build's): at most one tensor more than the model at any moment."""
    values = Values(model, who)
    for slot in values.slots:
        value = values.whole(slot)
        put(slot, value.to(device) if device is not None else value)
    forget(model)


def forget(model: nn.Module) -> None:
    """Drop the recordings, the weight file and the init function a built model carries (its tensors
    all have their values)."""
    for module in model.modules():
        module.__dict__.pop(ATTRIBUTE, None)
        module.__dict__.pop(SOURCE, None)
    model.__dict__.pop(INIT, None)
    model.__dict__.pop(CUTS, None)
