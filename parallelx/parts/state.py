"""Pure helpers about training state: random generators, optimizer state by
parameter name, CPU copies.  They take plain objects (an optimizer, a dict of
names), never a backend, and import nothing of parallelx but its leaves
(errors, log), so that the backend, the checkpoints and
the backends' own state code can all use them without import circles.
"""

from __future__ import annotations

import contextlib
import difflib
import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from parallelx import log
from parallelx.errors import ParallelxError


def to_cpu(obj: Any) -> Any:
    """A copy of ``obj`` with every tensor detached and on the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, Mapping):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


@contextlib.contextmanager
def keep_rng_state() -> Iterator[None]:
    """Run the block, then put Python's, NumPy's and torch's (CPU and CUDA)
    random number generators back where they were."""
    py, np_state, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(np_state)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


# ------------------------------------------------------- random numbers
def rng_state() -> dict[str, Any]:
    """This process's Python, NumPy and torch (CPU and CUDA) RNG states as
    tensors and plain values only (loadable with ``weights_only=True``)."""
    version, internal, gauss_next = random.getstate()
    np_name, keys, pos, has_gauss, cached = np.random.get_state()
    cuda = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = [t.clone() for t in torch.cuda.get_rng_state_all()]
    return {
        "python": {
            "version": int(version),
            "state": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
        "numpy": {
            "name": str(np_name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": cuda,
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state(
        (npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    cuda = state["cuda"]
    if cuda and torch.cuda.is_available():
        n = torch.cuda.device_count()
        if len(cuda) != n:
            log.warn(
                f"the checkpoint holds CUDA RNG states for {len(cuda)} device(s), this process sees {n}: "
                f"the first {min(n, len(cuda))} are restored"
            )
        for i, s in enumerate(cuda[:n]):
            torch.cuda.set_rng_state(s, i)
    elif cuda:
        log.warn("the checkpoint holds CUDA RNG states but CUDA is not available here; they are not restored")


# ------------------------------------------- optimizer state by parameter name
def named_optimizer_state(optimizer: Any, names: Mapping[int, str]) -> dict[str, Any]:
    """``optimizer.state_dict()`` with parameter indices replaced by names
    (``names`` maps ``id(parameter)`` to its name), tensors on the CPU."""
    plain = optimizer.state_dict()
    params = _names_in_order(optimizer.param_groups, names)
    state = {params[i]: to_cpu(s) for i, s in plain["state"].items()}
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [params[i] for i in g["params"]]}
        for g in plain["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def load_named_optimizer_state(optimizer: Any, names: Mapping[int, str], named: Mapping[str, Any]) -> None:
    """Load a state from :func:`named_optimizer_state` into ``optimizer``,
    matching parameters by name, whatever their order there."""
    check_named_groups(named, [[names.get(id(p), "?") for p in g["params"]] for g in optimizer.param_groups])
    order = _names_in_order(optimizer.param_groups, names)
    index = {n: i for i, n in enumerate(order)}
    groups = []
    for saved, live in zip(named["param_groups"], optimizer.param_groups):
        groups.append(
            {
                **{k: v for k, v in saved.items() if k != "params"},
                "params": [index[names[id(p)]] for p in live["params"]],
            }
        )
    state = {index[n]: s for n, s in named["state"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def indexed_optimizer_state(named: Mapping[str, Any]) -> dict[str, Any]:
    """The same state with names replaced by the positions ``torch.optim`` uses
    (in the order of the param groups' name lists)."""
    index: dict[str, int] = {}
    for g in named["param_groups"]:
        for n in g["params"]:
            index.setdefault(n, len(index))
    return {
        "state": {index[n]: s for n, s in named["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in named["param_groups"]],
    }


def named_from_indexed(plain: Mapping[str, Any], groups: Sequence[Sequence[str]]) -> dict[str, Any]:
    """Inverse of :func:`indexed_optimizer_state`, given each group's names."""
    check_named_groups(
        {"param_groups": [{"params": list(g)} for g in groups]},
        [[f"#{i}" for i in g["params"]] for g in plain["param_groups"]],
        names_only=False,
    )
    params = [n for g in groups for n in g]
    return {
        "state": {params[int(i)]: s for i, s in plain["state"].items()},
        "param_groups": [{**g, "params": list(names)} for g, names in zip(plain["param_groups"], groups)],
    }


def is_named_optimizer_state(state: Mapping[str, Any]) -> bool:
    """Whether ``state`` keys its parameters by name (``torch.distributed.checkpoint.state_dict.
    get_optimizer_state_dict``'s form, and parallelx's own ``state.pt``) rather than by the positions
    ``torch.optim`` uses.  A state that mixes the two, or torch's flattened form, is a
    :class:`ParallelxError`: nothing would load it right."""
    if not isinstance(state, Mapping):
        return False
    if "param_groups" not in state or "state" not in state:
        flat = [k for k in state if isinstance(k, str) and k.startswith(("state.", "param_groups."))]
        if flat:
            raise ParallelxError(
                f"this optimizer state is torch's flattened form (keys such as {flat[0]!r}); save it with "
                "get_optimizer_state_dict(model, optimizer, options=StateDictOptions("
                "flatten_optimizer_state_dict=False)), whose 'state' and 'param_groups' load on every backend"
            )
        return False  # the optimizer's own load_state_dict says what is missing
    keys = [*state["state"], *(p for g in state["param_groups"] for p in g.get("params", ()))]
    named = [k for k in keys if isinstance(k, str)]
    if named and len(named) != len(keys):
        position = next(k for k in keys if not isinstance(k, str))
        raise ParallelxError(
            f"the optimizer state keys some parameters by name ({named[0]!r}) and others by position "
            f"({position!r}); key all of them one way (torch's get_optimizer_state_dict names every one)"
        )
    return bool(named)


def named_state_for(
    named: Mapping[str, Any],
    names: Sequence[str],
    aliases: Mapping[str, str],
    shapes: Mapping[str, Sequence[int]],
    model: str = "the model",
) -> dict[str, Any]:
    """``named`` (optimizer state keyed by parameter name) keyed by ``names``, the model's own
    parameter names (``named_parameters()`` order, a tied parameter once, under its first name,
    as torch's ``get_optimizer_state_dict`` keys it); ``aliases`` maps a tied parameter's other
    names to that one.  A name the model does not have, an entry no group lists, a name listed
    twice and a tensor whose shape is not its parameter's (``shapes``, whole) are a
    :class:`ParallelxError` naming the key, so that nothing loads into the wrong parameter.
    Other top-level entries (a backend's own counters) pass through."""
    known = set(names)

    def canonical(key: str, where: str) -> str:
        for candidate in (key, _without_wrappers(key)):
            if candidate in known:
                return candidate
            if candidate in aliases:
                return aliases[candidate]
        close = difflib.get_close_matches(key, names, n=3)
        raise ParallelxError(
            f"the optimizer state (its {where}) names parameter {key!r}, which {model} does not have"
            + (f" (close: {', '.join(map(repr, close))})" if close else f" (it has {len(names)}: {list(names)[:4]}...)")
            + "; the state is of another model, or keyed by another module's names: torch's "
            "get_optimizer_state_dict(model, optimizer) keys it by model.named_parameters()"
        )

    groups: list[dict[str, Any]] = []
    listed: dict[str, str] = {}
    for i, group in enumerate(named["param_groups"]):
        params = []
        for key in group["params"]:
            name = canonical(key, f"param_groups[{i}]")
            if name in listed:
                raise ParallelxError(
                    f"the optimizer state's param_groups list {listed[name]!r} and {key!r}, one parameter of "
                    f"{model} ({name!r}, tied weights are one parameter); list it once, under {name!r}"
                )
            listed[name] = key
            params.append(name)
        groups.append({**group, "params": params})
    state: dict[str, Any] = {}
    for key, entry in named["state"].items():
        name = canonical(key, "'state'")
        if name not in listed:
            raise ParallelxError(
                f"the optimizer state holds an entry for {key!r}, which none of its param_groups lists; "
                "the state is not whole (save every group with the state)"
            )
        if name in state:
            raise ParallelxError(
                f"the optimizer state holds two entries for parameter {name!r} of {model} (tied weights are "
                "one parameter); keep one"
            )
        want = tuple(shapes[name])
        for k, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != want:
                raise ParallelxError(
                    f"the optimizer state's {k!r} of {key!r} has shape {tuple(value.shape)}, the parameter "
                    f"{want}; the state is of another model"
                )
        state[name] = entry
    return {**named, "state": state, "param_groups": groups}


#: Module names torch's wrappers put into parameter names (torch.compile's, activation checkpointing's).
_WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module")


def _without_wrappers(key: str) -> str:
    parts = [part for part in key.split(".") if part not in _WRAPPER_SEGMENTS]
    if parts and parts[0] == "module":  # a DDP (or DataParallel) wrapper's own parameter names
        parts = parts[1:]
    return ".".join(parts)


def check_named_groups(named: Mapping[str, Any], live: Sequence[Sequence[str]], *, names_only: bool = True) -> None:
    """A one-line error when the saved param groups do not hold the same
    parameters (by name, or only by count) as the live optimizer's."""
    saved = [list(g["params"]) for g in named["param_groups"]]
    if len(saved) != len(live):
        raise ParallelxError(
            f"the saved optimizer state has {len(saved)} parameter group(s) ({_groups_in_short(saved)}), this "
            f"optimizer {len(live)} ({_groups_in_short(live)}); build the optimizer as the run that saved it did"
        )
    for i, (s, here) in enumerate(zip(saved, live)):
        if (set(s) != set(here)) if names_only else (len(s) != len(here)):
            missing = sorted(set(here) - set(s))[:3] if names_only else []
            extra = sorted(set(s) - set(here))[:3] if names_only else []
            raise ParallelxError(
                f"parameter group {i} of the saved optimizer state holds {len(s)} parameters, "
                f"this optimizer's {len(here)}"
                + (f" (not saved: {missing}, not here: {extra})" if names_only else "")
                + "; the checkpoint is of another model or optimizer set-up"
            )


def _groups_in_short(groups: Sequence[Sequence[Any]]) -> str:
    """Each group's first parameters, e.g. ``['emb.weight', 'mid.bias', ...] | ['mid.weight']``."""
    return " | ".join(repr(list(g[:2])).replace("]", ", ...]" if len(g) > 2 else "]") for g in groups)


def _names_in_order(param_groups: Sequence[Mapping[str, Any]], names: Mapping[int, str]) -> list[str]:
    out = []
    for g in param_groups:
        for p in g["params"]:
            if id(p) not in names:
                raise ParallelxError(
                    "the optimizer holds a parameter that is not among the model's "
                    "named_parameters(); build the optimizer on model.parameters()"
                )
            out.append(names[id(p)])
    return out
