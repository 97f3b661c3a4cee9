"""DeepSpeed's mixture-of-experts layer (``deepspeed.moe.layer.MoE``) as the backends see it.

Under ``deepspeed`` a layer of ``num_experts`` experts keeps ``num_experts / ep_size`` of them on each
rank, as local experts ``0 .. L-1`` of its ``deepspeed_experts`` list: rank 1's expert 0 is the
layer's expert 1 at ``ep_size=2``.  A plain ``state_dict`` on each rank would therefore hold a
different model under the same keys, and rank 0's file (what ``backend.save`` writes) only its own
experts.  :class:`ExpertLayout` renames each local expert to its global index (the keys a model built
with ``ep_size=1`` has: every expert of every layer) and gathers the experts of every rank, for the
weights and for the optimizer's state; loading picks out this rank's experts again.  A portable
checkpoint is thus the whole model, loadable at any world size and ``ep_size`` with the same
``num_experts``.

The other backends have no expert-parallel groups, and the layer's forward fails inside (its token
exchange has no group): :func:`refuse_expert_layers` says so at ``wrap_model``.

Not a backend (the leading underscore).  ``deepspeed`` is never imported here to look: a model can
hold DeepSpeed's layer only once its module is imported.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from parallelx.errors import ParallelxError
from parallelx.parts.stateio import plain_key

#: The module path of DeepSpeed's layer, as users import it.
LAYER_MODULE = "deepspeed.moe.layer"


def expert_layers(model: nn.Module) -> list[tuple[str, Any]]:
    """Each ``deepspeed.moe.layer.MoE`` in ``model``, with its module path (plain names)."""
    layer = sys.modules.get(LAYER_MODULE)
    if layer is None:
        return []
    return [(plain_key(name), m) for name, m in model.named_modules() if isinstance(m, layer.MoE)]


def _where(path: str) -> str:
    return path or "the model itself"


def refuse_expert_layers(model: nn.Module, backend: str) -> None:
    """Raise on a backend without DeepSpeed's engine when ``model`` holds DeepSpeed's MoE layer."""
    found = expert_layers(model)
    if not found:
        return
    path, layer = found[0]
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    raise ParallelxError(
        f"{backend}: {_where(path)}{more} is DeepSpeed's mixture-of-experts layer (deepspeed.moe.layer.MoE, "
        f"{layer.num_experts} experts, ep_size={layer.ep_size}), which only DeepSpeed's engine runs: the engine "
        "places its experts on the ranks, exchanges the tokens and averages the experts' gradients in expert "
        f"groups that {backend} does not make. Run it under --backend deepspeed (ZeRO 0, 1 or 2), "
        "or write the mixture as a plain torch module (every expert an nn.Module of the model), which every "
        "backend trains as data parallel, each rank holding every expert"
    )


def check_stage(model: nn.Module, stage: int) -> None:
    """DeepSpeed refuses its MoE layer under ZeRO-3 (an assertion inside ``deepspeed.initialize``)."""
    found = expert_layers(model)
    if found and stage == 3:
        raise ParallelxError(
            f"deepspeed: {_where(found[0][0])} is DeepSpeed's mixture-of-experts layer, which DeepSpeed does not "
            "run under ZeRO-3 ('Native DeepSpeed MoE is not supported with ZeRO Stage 3'); use --zero-stage 0, 1 "
            "or 2"
        )


def check_groups(model: nn.Module, stage: int, optimizer: torch.optim.Optimizer) -> None:
    """ZeRO 1 and 2 partition the experts' state in their own groups, which they take from the optimizer's
    param groups marked ``moe`` (DeepSpeed asserts inside ``deepspeed.initialize`` otherwise)."""
    found = expert_layers(model)
    if not found or stage not in (1, 2) or any(g.get("moe") for g in optimizer.param_groups):
        return
    raise ParallelxError(
        f"deepspeed: ZeRO-{stage} partitions the experts of {_where(found[0][0])} (DeepSpeed's MoE layer) in "
        "optimizer param groups of their own, and no group of this optimizer is marked 'moe'; build the "
        "optimizer on deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer("
        "{'params': list(model.parameters()), 'name': 'parameters'}), as DeepSpeed's own examples do, or use "
        "--zero-stage 0"
    )


@dataclass(frozen=True)
class _Block:
    """One layer's experts: ``<prefix><index>.<rest>`` in a state dict."""

    layer: str
    prefix: str
    num_experts: int
    num_local: int
    #: The global index of this rank's local expert 0.
    first: int
    #: This rank holds the copy of its experts that gathers send (rank 0 of their expert-data-parallel group).
    sends: bool

    def index(self, key: str) -> tuple[int, str] | None:
        if not key.startswith(self.prefix):
            return None
        m = re.match(r"(\d+)\.(.+)", key[len(self.prefix) :])
        return (int(m.group(1)), m.group(2)) if m else None


class ExpertLayout:
    """This rank's experts of a module's DeepSpeed MoE layers, and the global names of every expert.

    Built once DeepSpeed has made its expert groups (the engine is built)."""

    def __init__(self, module: nn.Module) -> None:
        from deepspeed.utils import groups

        self.blocks: list[_Block] = []
        for path, layer in expert_layers(module):
            group = layer.expert_group_name
            num_local = int(layer.num_local_experts)
            self.blocks.append(
                _Block(
                    layer=_where(path),
                    prefix=f"{path}.deepspeed_moe.experts.deepspeed_experts."
                    if path
                    else "deepspeed_moe.experts.deepspeed_experts.",
                    num_experts=int(layer.num_experts),
                    num_local=num_local,
                    first=groups._get_expert_parallel_rank(group) * num_local,
                    sends=groups._get_expert_data_parallel_rank(group) == 0,
                )
            )
        #: The id of each expert parameter of this rank, and whether gathers and sums count this rank's copy.
        self.params: dict[int, bool] = {}
        for name, p in module.named_parameters():
            hit = self._find(plain_key(name))
            if hit is not None:
                self.params[id(p)] = hit[0].sends

    def _find(self, key: str) -> tuple[_Block, int, str] | None:
        for b in self.blocks:
            hit = b.index(key)
            if hit is not None:
                return b, hit[0], hit[1]
        return None

    # ------------------------------------------------------------ names
    def global_name(self, local: str) -> str:
        """A key of this rank's state with its expert's global index."""
        hit = self._find(local)
        if hit is None:
            return local
        b, j, rest = hit
        return f"{b.prefix}{b.first + j}.{rest}"

    def local_name(self, name: str) -> str | None:
        """A global key as this rank's state names it; None: an expert another rank holds."""
        hit = self._find(name)
        if hit is None:
            return name
        b, e, rest = hit
        if not b.first <= e < b.first + b.num_local:
            return None
        return f"{b.prefix}{e - b.first}.{rest}"

    def global_names(self, names: Mapping[int, str]) -> dict[int, str]:
        return {k: self.global_name(n) for k, n in names.items()}

    def whole_order(self, names: Sequence[str]) -> list[str]:
        """``names`` (this rank's, global) with each layer's experts in place of this rank's: every expert, in
        the order a model built with ``ep_size=1`` lists them (expert by expert, each one's tensors in order)."""
        out: list[str] = []
        done: set[str] = set()
        for name in names:
            hit = self._find(name)
            if hit is None:
                out.append(name)
                continue
            b = hit[0]
            if b.prefix in done:
                continue
            done.add(b.prefix)
            mine: list[tuple[int, str]] = []
            for n in names:
                h = self._find(n)
                if h is not None and h[0] is b:
                    mine.append((h[1], h[2]))
            rests = [rest for e, rest in mine if e == b.first]
            if sorted(mine) != sorted((b.first + j, r) for j in range(b.num_local) for r in rests):
                raise ParallelxError(
                    f"deepspeed: the optimizer's param groups split the experts of {b.layer} (DeepSpeed's MoE "
                    "layer) unevenly; give every expert's tensors to the same groups (as "
                    "split_params_into_different_moe_groups_for_optimizer does)"
                )
            out.extend(f"{b.prefix}{e}.{r}" for e in range(b.num_experts) for r in rests)
        return out

    # ------------------------------------------------------------ gathering
    def _gathered(self, entries: Mapping[str, Any]) -> dict[str, Any]:
        """Every rank's expert entries of ``entries`` (global keys), sent once per expert (a collective)."""
        sent = {k: v for k, v in entries.items() if (hit := self._find(k)) is not None and hit[0].sends}
        everyone: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, sent)
        merged: dict[str, Any] = {}
        for part in everyone:
            for k, v in part.items():
                merged.setdefault(k, v)
        return merged

    def gather_model(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's model state (CPU tensors, local keys) as the whole model's: every expert, global keys."""
        renamed = {self.global_name(k): v for k, v in state.items()}
        experts = self._gathered(renamed)
        out: dict[str, torch.Tensor] = {}
        for k in self.whole_order(list(renamed)):
            out[k] = renamed[k] if k in renamed and self._find(k) is None else experts[k]
        return out

    def gather_optimizer(self, named: Mapping[str, Any]) -> dict[str, Any]:
        """A named optimizer state of this rank (global names) with every rank's experts' state in it."""
        experts = self._gathered(named["state"])
        groups = [{**g, "params": self.whole_order(g["params"])} for g in named["param_groups"]]
        # Parameters without state (not stepped yet) stay without.
        state = {}
        for n in (n for g in groups for n in g["params"]):
            entry = experts.get(n) if self._find(n) is not None else named["state"].get(n)
            if entry is not None:
                state[n] = entry
        return {**named, "state": state, "param_groups": groups}

    # ------------------------------------------------------------ loading
    def check_complete(self, keys: Iterable[str], what: str) -> None:
        """Raise unless ``keys`` (a whole state's) hold every expert of every layer, and no more."""
        keys = list(keys)
        for b in self.blocks:
            held = sorted({hit[0] for k in keys if (hit := b.index(k)) is not None})
            if held and held != list(range(b.num_experts)):
                raise ParallelxError(
                    f"deepspeed: the {what} holds experts {held} of {b.layer} (DeepSpeed's MoE layer), the model "
                    f"has {b.num_experts} (numbered 0 to {b.num_experts - 1} in a whole state); it was saved from "
                    "another model, or by a version that wrote rank 0's experts only; save it again from the run "
                    "that trained it"
                )

    def local_model(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """A whole model state narrowed to this rank's experts, under its local keys."""
        self.check_complete(state, "model state")
        return {local: v for k, v in state.items() if (local := self.local_name(k)) is not None}

    def local_optimizer(self, named: Mapping[str, Any]) -> dict[str, Any]:
        """A whole named optimizer state narrowed to this rank's experts, under its local names."""
        self.check_complete([n for g in named["param_groups"] for n in g["params"]], "optimizer state")

        def narrow(names: Iterable[str]) -> list[str]:
            return [local for n in names if (local := self.local_name(n)) is not None]

        state = {local: s for n, s in named["state"].items() if (local := self.local_name(n)) is not None}
        groups = [{**g, "params": narrow(g["params"])} for g in named["param_groups"]]
        return {**named, "state": state, "param_groups": groups}


def expert_norm(
    params: Sequence[torch.Tensor], layout: ExpertLayout, all_reduce: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """The 2-norm of the whole averaged gradient of a model whose experts are spread over the ranks
    (ZeRO-0, after the engine's reduction): each parameter's norm as ``get_total_norm`` takes it, the
    experts' squares summed over the ranks that send them (each expert once), then the norm of those
    norms.  The same on every rank, and what one process holding every expert computes, up to the order
    of additions.  (DeepSpeed's own clipping takes the mean of each rank's norm of its local gradients.)"""
    if not params:
        return torch.zeros(())
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    norms = list(torch._foreach_norm(grads, 2.0))
    expert = [i for i, p in enumerate(params) if id(p) in layout.params]
    squares = torch.zeros(len(expert), dtype=torch.float64, device=grads[0].device)
    for row, i in enumerate(expert):
        if layout.params[id(params[i])]:
            squares[row] = norms[i].double() ** 2
    squares = all_reduce(squares)
    for row, i in enumerate(expert):
        norms[i] = squares[row].sqrt().to(norms[i].dtype)
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)
