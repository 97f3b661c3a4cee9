"""Which submodules of a model are its "units": the blocks that ``fsdp``
shards one at a time, that activation checkpointing recomputes, and that
``torch.compile`` compiles one by one.

A unit must be a module with a ``forward`` of its own (``ModuleDict`` and
``ModuleList`` only hold modules: ``fully_shard`` refuses them), and it must
hold every use of its parameters: a weight tied to a module outside it (GPT's
token embedding and output layer) stays with the enclosing unit or the root,
which runs both uses.

Chosen by a :data:`UnitPolicy`: ``None`` (:func:`default_units`: the blocks
the model repeats, else those that hold a large share of the parameters), a predicate on modules, or module
classes given as types or by name (``"Block"``, ``"GPT2Block"``, ``"Linear"``),
which is what a command line passes (:func:`parse_names`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from parallelx.errors import ParallelxError

#: ``None`` (the default units), a predicate on modules, or module classes (types or class names).
UnitPolicy = Callable[[nn.Module], bool] | Sequence[type[nn.Module] | str] | None

#: torch's generic containers: never "the blocks a model repeats".
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)

#: A submodule is a default unit when it holds at least this share of the parameters not already in a unit below it.
LARGE_SHARE = 0.1


def has_forward(module: nn.Module) -> bool:
    """True unless ``module`` is a container without a ``forward`` of its own."""
    return type(module).forward is not nn.Module.forward


def _registrations(model: nn.Module) -> dict[int, list[str]]:
    """For each parameter (by ``id``), the names of the modules it is registered on (a tied weight has several)."""
    places: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for _, p in module.named_parameters(recurse=False, remove_duplicate=False):
            places.setdefault(id(p), []).append(path)
    return places


def _self_contained(path: str, module: nn.Module, places: dict[int, list[str]]) -> bool:
    """True when every module that uses a parameter of ``module`` lies inside it."""
    return all(
        all(place == path or place.startswith(path + ".") for place in places[id(p)]) for p in module.parameters()
    )


#: Modules that read their submodules' parameters without calling them: ``nn.MultiheadAttention``
#: hands ``out_proj.weight`` to ``F.multi_head_attention_forward``, so a unit's hooks on ``out_proj``
#: would never run (fsdp would leave it sharded: "got mixed torch.Tensor and DTensor").
READS_CHILDREN = (nn.MultiheadAttention,)


def eligible(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The submodules that can be units, by name, in ``named_modules`` order."""
    places = _registrations(model)
    inside = {id(sub) for m in model.modules() if isinstance(m, READS_CHILDREN) for sub in m.modules() if sub is not m}
    return [
        (path, m)
        for path, m in model.named_modules()
        if m is not model
        and id(m) not in inside
        and has_forward(m)
        and any(True for _ in m.parameters())
        and _self_contained(path, m, places)
    ]


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks a model repeats: the eligible modules of the one class that
    comes at least twice among the children of one container (a transformer's
    layers in their ``ModuleList``, a ResNet's residual blocks) and is itself
    built of modules, the class holding the most parameters; empty when none is."""
    allowed = {id(m) for _, m in eligible(model)}
    counts: dict[type[nn.Module], list[nn.Module]] = {}
    for container in model.modules():
        siblings: dict[type[nn.Module], list[nn.Module]] = {}
        for child in container.children():
            # A block is a module of the model's own, built of modules: not a generic container.
            if id(child) in allowed and not isinstance(child, CONTAINERS) and any(True for _ in child.children()):
                siblings.setdefault(type(child), []).append(child)
        for cls, found in siblings.items():
            if len(found) >= 2:
                counts.setdefault(cls, []).extend(found)
    if not counts:
        return []
    best = max(counts.values(), key=lambda found: sum(p.numel() for m in found for p in m.parameters()))
    chosen = {id(m) for m in best}
    # Innermost first, as fully_shard wants them; a block inside another chosen block stays with it.
    ordered = [m for m in model.modules() if id(m) in chosen]
    outer = [m for m in ordered if not any(o is not m and any(x is m for x in o.modules()) for o in ordered)]
    return list(reversed(outer))


def default_units(model: nn.Module, share: float = LARGE_SHARE) -> list[nn.Module]:
    """The units, innermost first: the model's repeated blocks
    (:func:`repeated_blocks`), or, in a model without any, each eligible
    submodule that holds at least ``share`` of the parameters not already in
    a unit below it.  The root then takes what is left."""
    blocks = repeated_blocks(model)
    if blocks:
        return blocks
    allowed = {id(m) for _, m in eligible(model)}
    total = sum(p.numel() for p in model.parameters())
    units: list[nn.Module] = []
    taken: set[int] = set()

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        if module is model or id(module) not in allowed:
            return
        left = sum(p.numel() for p in module.parameters() if id(p) not in taken)
        if total and left >= share * total:
            units.append(module)
            taken.update(id(p) for p in module.parameters())

    visit(model)
    return units


def select_units(model: nn.Module, policy: UnitPolicy, *, who: str) -> list[nn.Module]:
    """The units ``policy`` chooses in ``model``, innermost first.  Class names
    must name a class of this model (or of ``torch.nn``); a chosen module that
    cannot be a unit (a container, or one whose weight is tied outside it) is
    an error that says why.  ``who`` names the feature in errors."""
    if policy is None:
        return default_units(model)
    ok = {id(m) for _, m in eligible(model)}
    if callable(policy):
        chosen = [(path, m) for path, m in model.named_modules() if m is not model and policy(m)]
    else:
        classes = {type(m).__name__ for m in model.modules()}
        unknown = [n for n in policy if isinstance(n, str) and n not in classes and not hasattr(nn, n)]
        if unknown:
            raise ParallelxError(
                f"{who}: {', '.join(unknown)} is no module class of this model; its classes are "
                f"{', '.join(sorted(classes))} (or give auto)"
            )
        names = {n for n in policy if isinstance(n, str)}
        types = tuple(t for t in policy if isinstance(t, type))
        chosen = [
            (path, m)
            for path, m in model.named_modules()
            if m is not model and (type(m).__name__ in names or (types and isinstance(m, types)))
        ]
    chosen = [(path, m) for path, m in chosen if any(True for _ in m.parameters())]
    bad = [path for path, m in chosen if id(m) not in ok]
    if bad:
        raise ParallelxError(
            f"{who}: {bad[0]} ({type(dict(model.named_modules())[bad[0]]).__name__}) cannot be a unit: it is a "
            "container without forward, a weight in it is tied to a module outside it, or the module around it "
            "reads its weights without calling it (an attention's out_proj); choose the blocks inside it, the "
            "module around it, or auto"
        )
    return [m for _, m in reversed(chosen)]


def parse_names(text: str | None) -> list[str] | None:
    """A command line's ``auto`` (None: the default units) or comma-separated module class names."""
    if text is None or text.strip() in ("", "auto"):
        return None
    return [name.strip() for name in text.split(",") if name.strip()]
