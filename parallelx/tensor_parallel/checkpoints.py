"""Portable state under tensor parallelism: the engine's state part, with every split
tensor put together whole on the way out and cut to this rank's slice on the way in.

The engine's own part (:class:`parallelx.parts.stateio.StateIO` or fsdp's, ZeRO's)
gives or takes each rank's tensors as that engine holds them (fsdp: gathered over
the data-parallel ranks); this one adds the tensor-parallel step, by parameter
name for the model and a name-keyed optimizer state, by position for
``optimizer.state_dict()``.  So a checkpoint written at tensor parallel 2 x data
parallel 2 holds the tensors one process has, and loads at any other degree, on
any backend.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from parallelx.errors import ParallelxError
from parallelx.parts.shards import ParameterShards
from parallelx.parts.stateio import StateIO, plain_key
from parallelx.storage import Location
from parallelx.tensor_parallel.part import Layout, TensorParallel, local_slice

__all__ = ["TensorParallelShards", "TensorParallelStateIO"]


class TensorParallelStateIO(StateIO):
    """``inner`` (the engine's state part) with the split tensors whole outside."""

    def __init__(self, inner: StateIO, tp: TensorParallel) -> None:
        super().__init__(inner.unwrap)
        self.inner, self.tp = inner, tp

    def remember(self, optimizer: Any, params: Iterable[torch.Tensor]) -> None:
        params = list(params)
        super().remember(optimizer, params)
        self.inner.remember(optimizer, params)

    # ------------------------------------------------------------ layouts
    def _by_name(self, model: nn.Module) -> dict[str, Layout]:
        return {plain_key(k): v for k, v in self.tp.layouts(self.unwrap(model)).items()}

    def _by_position(self, optimizer: Any) -> dict[int, Layout]:
        """Each split parameter's layout by its index in ``optimizer.state_dict()``."""
        layouts: dict[int, Layout] = {}
        for model in self._models():
            names = {id(p): plain_key(n) for n, p in model.named_parameters(remove_duplicate=False)}
            own = self._by_name(model)
            index = 0
            for group in optimizer.param_groups:
                for p in group["params"]:
                    name = names.get(id(p))
                    if name in own:
                        layouts[index] = own[name]
                    index += 1
        return layouts

    def _models(self) -> list[nn.Module]:
        return self.tp.models()

    def whole_shape(self, param: torch.Tensor) -> tuple[int, ...]:
        shape = self.inner.whole_shape(param)
        if not self.tp.is_split(param):
            return shape
        for model in self._models():
            for name, p in model.named_parameters():
                if p is param:
                    return self.tp.whole_shape(model, name, shape)
        return shape

    # ------------------------------------------------------------ the model
    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        state = self.inner.model_state_dict(model)
        layouts = self._by_name(model)
        return {k: self.tp.gather(v, layouts[k]) if k in layouts else v for k, v in state.items()}

    def load_model_state_dict(self, model: nn.Module, state: Mapping[str, Any]) -> None:
        self.inner.load_model_state_dict(model, self._cut(state, self._by_name(model), model))

    def _cut(self, state: Mapping[str, Any], layouts: Mapping[Any, Layout], model: nn.Module | None) -> dict[Any, Any]:
        out = dict(state)
        rank, size = self.tp.mesh.tp_rank, self.tp.size
        for key, layout in layouts.items():
            value = out.get(key)
            if isinstance(value, torch.Tensor) and value.dim() > layout.dim:
                if value.shape[layout.dim] % size:
                    raise ParallelxError(
                        f"tensor parallel: the checkpoint's {key} has {value.shape[layout.dim]} rows along dim "
                        f"{layout.dim}, which {size} ranks cannot share: is it this model's?"
                    )
                out[key] = local_slice(value, layout.dim, layout.parts, rank, size).clone()
        return out

    # ------------------------------------------------------------ the optimizer
    def optimizer_state_dict(self, optimizer: Any) -> dict[str, Any] | None:
        state = self.inner.optimizer_state_dict(optimizer)
        if state is None:
            return None
        layouts = self._by_position(optimizer)
        return {**state, "state": {i: self._gather_entry(s, layouts.get(i)) for i, s in state["state"].items()}}

    def load_optimizer_state_dict(self, optimizer: Any, state: Mapping[str, Any]) -> None:
        layouts = self._by_position(optimizer)
        cut = {i: self._cut_entry(s, layouts.get(i)) for i, s in state["state"].items()}
        self.inner.load_optimizer_state_dict(optimizer, {**state, "state": cut})

    def named_optimizer_state(self, model: nn.Module, optimizer: Any) -> dict[str, Any]:
        named = self.inner.named_optimizer_state(model, optimizer)
        layouts = self._by_name(model)
        return {**named, "state": {n: self._gather_entry(s, layouts.get(n)) for n, s in named["state"].items()}}

    def load_named_optimizer_state(self, model: nn.Module, optimizer: Any, state: Mapping[str, Any]) -> None:
        layouts = self._by_name(model)
        cut = {n: self._cut_entry(s, layouts.get(n)) for n, s in state["state"].items()}
        self.inner.load_named_optimizer_state(model, optimizer, {**state, "state": cut})

    def _gather_entry(self, entry: Mapping[str, Any], layout: Layout | None) -> dict[str, Any]:
        if layout is None:
            return dict(entry)
        return {k: self.tp.gather(v, layout) if _sliced(v, layout) else v for k, v in entry.items()}

    def _cut_entry(self, entry: Mapping[str, Any], layout: Layout | None) -> dict[str, Any]:
        if layout is None:
            return dict(entry)
        rank, size = self.tp.mesh.tp_rank, self.tp.size
        return {
            k: local_slice(v, layout.dim, layout.parts, rank, size).clone() if _sliced(v, layout) else v
            for k, v in entry.items()
        }

    # ------------------------------------------------------------ sharded checkpoints
    def sharded_state(self, model: nn.Module, optimizer: Any) -> dict[str, Any] | None:
        if self.inner.sharded_state(model, optimizer) is not None:
            raise ParallelxError(
                "tensor parallel: sharded training-state checkpoints (--fsdp-sharded-checkpoints, "
                "--zero-sharded-checkpoints) are not offered "
                "with --tensor-parallel: leave that option out; the portable checkpoints hold whole tensors and "
                "load at any tensor-parallel degree"
            )
        return None

    def load_sharded_state(
        self, model: nn.Module, optimizer: Any, directory: Location, saved: Mapping[str, Any]
    ) -> bool:
        return self.inner.load_sharded_state(model, optimizer, directory, saved)

    def checkpoint_meta(self) -> dict[str, Any]:
        return {**self.inner.checkpoint_meta(), "tensor_parallel": self.tp.size}

    def __getattr__(self, name: str) -> Any:  # an engine's own helpers (fsdp's, ZeRO's)
        return getattr(self.__dict__["inner"], name)


def _sliced(value: Any, layout: Layout) -> bool:
    # A step count or a scalar is whole; moments have the parameter's shape.
    return isinstance(value, torch.Tensor) and value.dim() > layout.dim


class TensorParallelShards(ParameterShards):
    """A weight average's view (:class:`parallelx.EMA`) of a split model: ``inner``'s (the engine's)
    shares, with the split tensors whole when gathered and cut again when scattered."""

    sharded = True

    def __init__(self, inner: ParameterShards, tp: TensorParallel) -> None:
        super().__init__(inner.module)
        self.inner, self.tp = inner, tp
        self.layouts = {plain_key(k): v for k, v in tp.layouts(inner.module).items()}

    def local(self) -> dict[str, torch.Tensor]:
        return self.inner.local()

    def gather(self, shards: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        whole = self.inner.gather(shards)
        return {n: self.tp.gather(t, self.layouts[n]) if n in self.layouts else t for n, t in whole.items()}

    def scatter(self, whole: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        rank, size = self.tp.mesh.tp_rank, self.tp.size
        cut = {
            n: local_slice(t, self.layouts[n].dim, self.layouts[n].parts, rank, size) if n in self.layouts else t
            for n, t in whole.items()
        }
        return self.inner.scatter(cut)

    def written(self) -> None:
        self.inner.written()
