"""Pure helpers about training state: random generators, optimizer state by
parameter name, CPU copies.  They take plain objects (an optimizer, a dict of
names), never a backend, and import nothing of parallelx but its leaves
(errors, log), so that the backend, the checkpoints and
the backends' own state code can all use them without import circles.
"""

from __future__ import annotations

import contextlib
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


def check_named_groups(named: Mapping[str, Any], live: Sequence[Sequence[str]], *, names_only: bool = True) -> None:
    """A one-line error when the saved param groups do not hold the same
    parameters (by name, or only by count) as the live optimizer's."""
    saved = [list(g["params"]) for g in named["param_groups"]]
    if len(saved) != len(live):
        raise ParallelxError(
            f"the saved optimizer state has {len(saved)} parameter group(s), this optimizer "
            f"{len(live)}; build the optimizer as the run that saved it did"
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
