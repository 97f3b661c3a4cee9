"""The tensor-parallel part: applies a plan to a model and keeps what it split.

:meth:`TensorParallel.apply` runs in ``backend.wrap_model`` before the engine
wraps the model (DDP over the data-parallel group, FSDP2 over its mesh): every
rank takes rank 0's whole weights (as DDP does at construction), then keeps its
slice of each split layer, in place; a model still on the meta device has its split tensors cut as
shapes, and the backend then computes (or reads from a weight file) only each rank's slices (the parameters stay the same objects, so
an optimizer built before set-up still holds them).  A split ``nn.Linear``
becomes a :class:`ColwiseLinear` or :class:`RowwiseLinear` (the same module with
the forward that talks to its group, :mod:`parallelx.tensor_parallel.comm`).

What it keeps by parameter name serves the state part (every split tensor put
together whole for a portable checkpoint, and cut again on loading, so that a
checkpoint moves between tensor-parallel degrees and backends) and the gradient
norm (a split gradient's squares summed over the group, a whole one counted once).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallelx import log
from parallelx.bigmodels.meta import cut as cut_meta
from parallelx.bigmodels.meta import has_meta
from parallelx.errors import ParallelxError
from parallelx.parts.lockstep import ForwardLockstep
from parallelx.parts.mesh import Mesh, tensor_parallel_groups
from parallelx.tensor_parallel import comm
from parallelx.tensor_parallel.plan import Plan, find_plan

__all__ = ["ColwiseLinear", "RowwiseLinear", "TensorParallel", "VocabEmbedding", "local_slice", "whole_from_slices"]


def local_slice(whole: torch.Tensor, dim: int, parts: int, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s slice of ``whole`` along ``dim``; a fused tensor's ``parts`` each sliced alike."""
    pieces = [p.chunk(size, dim=dim)[rank] for p in whole.chunk(parts, dim=dim)]
    return torch.cat(pieces, dim=dim) if parts > 1 else pieces[0]


def whole_from_slices(slices: list[torch.Tensor], dim: int, parts: int) -> torch.Tensor:
    """The tensor whose slices (in rank order) ``slices`` are: the inverse of :func:`local_slice`."""
    split = [s.chunk(parts, dim=dim) for s in slices]
    return torch.cat([torch.cat([s[k] for s in split], dim=dim) for k in range(parts)], dim=dim)


class ColwiseLinear(nn.Linear):
    """An ``nn.Linear`` holding this rank's output features: reads the whole input (under sequence
    parallelism the module that holds it gathers the sequence first), gives this rank's slice of the output."""

    tp_group: Any
    sequence_parallel: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under sequence parallelism the module around it gathered the sequence, and that gather's
        # backward sums the input's gradient over the group.
        if not self.sequence_parallel:
            x = comm.copy_in(x, self.tp_group)
        elif getattr(self, "gathers", False):  # a layer straight inside a block: it gathers for itself
            x = comm.gather_sequence(x, self.tp_group)
        y = F.linear(x, self.weight, self.bias)
        shards = getattr(self, "shards_output", None)
        if shards is not None and self.training and torch.is_grad_enabled():
            # --loss-parallel: a training forward's logits stay in vocabulary shards, a DTensor, for the loss;
            # evaluation and generation (eval mode or no_grad: no backward to keep them for) get them whole.
            return shards(y)
        if getattr(self, "gathers_output", False):  # the output head: the script's loss sees whole logits
            y = comm.join_sequence(y, self.tp_group, dim=-1)
        return y


class VocabEmbedding(nn.Embedding):
    """An ``nn.Embedding`` holding this rank's rows of the vocabulary: a token outside them looks up
    zeros, and the ranks' lookups are summed (each token's row comes from one rank: exact)."""

    tp_group: Any
    vocab_start: int

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.num_embeddings)
        rows = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        return comm.reduce_out(rows * inside.unsqueeze(-1).to(rows.dtype), self.tp_group)


class RowwiseLinear(nn.Linear):
    """An ``nn.Linear`` holding this rank's input features: the partial products summed over the
    group (reduce-scattered along the sequence under sequence parallelism), the bias added once."""

    tp_group: Any
    sequence_parallel: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        y = comm.scatter_sequence(y, self.tp_group) if self.sequence_parallel else comm.reduce_out(y, self.tp_group)
        return y if self.bias is None else y + self.bias


def _fused_attention_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """nanoGPT's causal self-attention on this rank's heads: ``c_attn`` gives this rank's q, k and v
    (its heads' slices of each), ``c_proj`` sums the heads' outputs over the group."""
    B, T, _ = x.shape
    q, k, v = self.c_attn(x).chunk(3, dim=-1)
    heads = self.n_head
    q, k, v = (t.view(B, T, heads, t.shape[-1] // heads).transpose(1, 2) for t in (q, k, v))
    p = float(getattr(self, "dropout", 0.0) or 0.0) if self.training else 0.0
    y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
    y = y.transpose(1, 2).reshape(B, T, -1)
    out = self.c_proj(y)
    drop = getattr(self, "resid_dropout", None)
    return drop(out) if isinstance(drop, nn.Module) else out


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one parameter is split: along ``dim``, in ``parts`` fused parts."""

    dim: int
    parts: int = 1


class TensorParallel:
    """Applies plans over ``mesh``'s tensor-parallel group and remembers the split parameters."""

    def __init__(
        self,
        mesh: Mesh,
        *,
        sequence_parallel: bool = False,
        plan: Mapping[str, str] | None = None,
        loss_parallel: bool = False,
    ) -> None:
        self.mesh = mesh
        self.sequence_parallel = sequence_parallel
        self.loss_parallel = loss_parallel
        #: torch's loss_parallel() while --loss-parallel's logits are in use (entered at the first split head).
        self._loss_context: contextlib.ExitStack | None = None
        self._device_mesh: Any = None
        self.given_plan = dict(plan) if plan else None
        #: Per model (the user's module), each split tensor's layout by name.
        self._layouts: weakref.WeakKeyDictionary[nn.Module, dict[str, Layout]] = weakref.WeakKeyDictionary()
        #: The split parameters as objects (ids) and their layouts, refreshed after an engine replaces
        #: them (:meth:`track`).
        self._layout_ids: dict[int, Layout] = {}
        #: Under sequence parallelism, the whole-kept parameters whose gradients are partial sums.
        self._partial: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()
        self._partial_ids: set[int] = set()
        self._checked: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self.lockstep: ForwardLockstep | None = None

    @property
    def size(self) -> int:
        return self.mesh.tp_size

    @property
    def group(self) -> Any:
        return self.mesh.tp_group

    # ------------------------------------------------------------ applying
    def apply(self, model: nn.Module, device: torch.device, who: str) -> Plan:
        """Split ``model``'s layers in place by its plan (found and checked first: a refusal changes nothing)."""
        plan = find_plan(model, self.size, self.given_plan)
        if self.sequence_parallel:
            self._check_sequence_parallel(model, plan, who)
        if self.loss_parallel and not any(split.gather for split in plan.splits.values()):
            raise ParallelxError(
                f"{who}: --loss-parallel computes the loss on the output head's vocabulary shards, and this model's "
                f"plan splits no output head ({plan.describe(self.size)}); leave --loss-parallel out"
            )
        modules = dict(model.named_modules())
        # A model on the meta device (parallelx.init_module(), or given a weight file by load_pretrained)
        # has no values yet: its split tensors are cut as shapes, and the backend's materialisation then
        # computes, or reads from the file, only this rank's slices (meta.Cut).
        meta = has_meta(model)
        if not meta:
            model.to(device)
            with torch.no_grad():  # rank 0's whole weights everywhere, then each rank keeps its slices
                for t in [*model.parameters(), *model.buffers()]:
                    dist.broadcast(t.data, src=0)
        layouts: dict[str, Layout] = {}
        rank, size = self.mesh.tp_rank, self.size
        done: set[int] = set()  # a tied weight (the embedding and the head) is one tensor: cut once

        def keep_slice(p: torch.Tensor, dim: int, parts: int) -> None:
            if id(p) in done:
                return
            if p.is_meta:
                cut_meta(model, p, dim, parts, rank, size)
            else:
                p.data = local_slice(p.data, dim, parts, rank, size).clone()
            done.add(id(p))

        for name, split in plan.splits.items():
            layer = modules[name]
            if split.style == "vocab":
                assert isinstance(layer, nn.Embedding)
                rows = layer.num_embeddings // size
                with torch.no_grad():
                    keep_slice(layer.weight, 0, 1)
                layouts[f"{name}.weight"] = Layout(0)
                layer.__class__ = VocabEmbedding
                layer.tp_group, layer.num_embeddings = self.group, rows
                layer.vocab_start = rank * rows  # type: ignore[assignment]
                layer.weight.tensor_model_parallel = True  # type: ignore[attr-defined]
                continue
            assert isinstance(layer, nn.Linear)
            dim = 0 if split.style == "colwise" else 1
            with torch.no_grad():
                keep_slice(layer.weight, dim, split.parts)
                layouts[f"{name}.weight"] = Layout(dim, split.parts)
                if layer.bias is not None and split.style == "colwise":
                    keep_slice(layer.bias, 0, split.parts)
                    layouts[f"{name}.bias"] = Layout(0, split.parts)
            for p in (layer.weight, layer.bias if split.style == "colwise" else None):
                if p is not None:  # the mark Megatron-LM and DeepSpeed read (their clipping counts it per slice)
                    p.tensor_model_parallel = True  # type: ignore[attr-defined]
            layer.__class__ = ColwiseLinear if split.style == "colwise" else RowwiseLinear
            layer.tp_group = self.group
            # Sequence parallelism is the blocks' business; the head reads the joined sequence.
            layer.sequence_parallel = self.sequence_parallel and split.in_blocks  # type: ignore[assignment]
            layer.gathers_output = split.gather  # type: ignore[assignment]
            if split.gather and self.loss_parallel:
                layer.shards_output = self._vocabulary_shards(device)
            layer.out_features = layer.weight.shape[0]
            layer.in_features = layer.weight.shape[1]
        for name, heads in plan.attention.items():
            for attr, count in heads.items():
                setattr(modules[name], attr, count // size)
        for name in plan.fused_attention:
            modules[name].forward = types.MethodType(_fused_attention_forward, modules[name])
        self._layouts[model] = layouts
        if self.sequence_parallel:
            self._sequence_regions(model, plan)
        self.track(model)
        model.register_forward_pre_hook(self._same_batch_check, with_kwargs=True)
        if self.mesh.data_rank == 0 and self.mesh.tp_rank == 0:
            log.info(
                f"parallelx: {who}: {plan.describe(size)}{', sequence parallel' if self.sequence_parallel else ''}"
            )
        return plan

    # ------------------------------------------------------------ the loss on vocabulary shards
    def _vocabulary_shards(self, device: torch.device) -> Any:
        """What the output head returns under ``--loss-parallel``: its logits as torch's ``DTensor``
        sharded along the vocabulary over the group, with torch's ``loss_parallel`` on from here to
        the end of the run (its ``F.cross_entropy`` and the backward of it then work on the shards:
        a max and a sum of exponentials all-reduced, never the whole logits)."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor.parallel import loss_parallel

        if self._device_mesh is None:
            self._device_mesh = DeviceMesh.from_group(self.group, device.type)
            self._loss_context = contextlib.ExitStack()
            self._loss_context.enter_context(loss_parallel())
        mesh = self._device_mesh

        def shards(local: torch.Tensor) -> torch.Tensor:
            return DTensor.from_local(local, mesh, [Shard(local.dim() - 1)], run_check=False)

        return shards

    def close(self) -> None:
        """The end of the run: torch's ``loss_parallel`` off again (it changes how every ``DTensor``
        computes a cross-entropy, in this process)."""
        if self._loss_context is not None:
            self._loss_context.close()
            self._loss_context = None

    def guard(self, model: nn.Module, timeout_s: float) -> None:
        """Every forward of a split model is a collective of its tensor-parallel group: before each, the
        group's ranks agree that they run the same one (:class:`ForwardLockstep`, one all-reduce of 4
        integers on a Gloo group of its own), so a forward on one rank alone (``if rank == 0:
        evaluate(model)``) is one clear error naming the forward, not a hang inside a split layer.  Other
        groups may run other forwards (a data-parallel rank evaluating alone).  A model an engine already
        checks over every rank (fsdp) is left to that check."""
        if self.lockstep is None:  # every rank wraps its models at the same point: the groups are made once
            self.lockstep = ForwardLockstep(
                "tensor parallelism",
                dist.get_rank(),
                timeout_s,
                groups=tensor_parallel_groups(self.mesh.data_size * self.size, self.size),
                why="its split layers sum their pieces over the tensor-parallel ranks",
            )
        self.lockstep.guard(model)

    def track(self, model: nn.Module) -> None:
        """Remember ``model``'s split parameters as the objects it holds now (an engine may have replaced them)."""
        layouts = self._layouts.get(model, {})
        partial = self._partial.get(model, set())
        for name, p in model.named_parameters(remove_duplicate=False):
            if name in layouts:
                self._layout_ids[id(p)] = layouts[name]
            if name in partial:
                self._partial_ids.add(id(p))

    def layouts(self, model: nn.Module) -> dict[str, Layout]:
        """The split tensors of ``model`` by name: a model set up, or a module inside one (its names)."""
        if model in self._layouts:
            return self._layouts[model]
        for root, layouts in self._layouts.items():
            for prefix, sub in root.named_modules():
                if sub is model and prefix:
                    return {n[len(prefix) + 1 :]: v for n, v in layouts.items() if n.startswith(f"{prefix}.")}
        return {}

    def models(self) -> list[nn.Module]:
        """The models split so far (still alive)."""
        return list(self._layouts.keys())

    def is_split(self, param: torch.Tensor) -> bool:
        return id(param) in self._layout_ids

    # ------------------------------------------------------------ the data
    def _same_batch_check(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """At a model's first forward: the tensor-parallel peers must read the same batch (a few numbers
        compared); a script that shards its data by ``backend.rank`` gives them different ones."""
        if module in self._checked:
            return
        self._checked.add(module)
        tensors = [t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)]
        mine = torch.tensor(
            [float(len(tensors))] + [v for t in tensors for v in (float(t.numel()), float(t.double().sum()))],
            dtype=torch.float64,
        )
        size = torch.tensor([mine.numel()], dtype=torch.int64)
        sizes = [torch.zeros_like(size) for _ in range(self.size)]
        dist.all_gather(sizes, size, group=self.group)
        longest = int(max(s.item() for s in sizes))
        padded = torch.full((longest,), math.nan, dtype=torch.float64)
        padded[: mine.numel()] = mine
        everyone = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(everyone, padded, group=self.group)
        if any(not torch.equal(e.nan_to_num(-1.0), everyone[0].nan_to_num(-1.0)) for e in everyone):
            m = self.mesh
            raise ParallelxError(
                f"tensor parallel: the {m.tp_size} ranks of one tensor-parallel group read different batches "
                f"at the model's first forward; they must read the same one.  Shard the data by the data-parallel "
                f"coordinates, not by backend.rank/world_size: backend.mesh.data_rank ({m.data_rank} here) and "
                f"backend.mesh.data_size ({m.data_size}), or backend.make_sampler(dataset), which does; seed the "
                "data by the data-parallel rank too"
            )

    # ------------------------------------------------------------ sequence parallelism
    def _check_sequence_parallel(self, model: nn.Module, plan: Plan, who: str) -> None:
        blocks = _blocks(model, plan)
        if blocks is None:
            raise ParallelxError(
                f"{who}: --sequence-parallel shards the activations between the split layers along the sequence: "
                "parallelx finds that region as the model's list of blocks (an nn.ModuleList holding every split "
                "layer), which this model does not have; leave --sequence-parallel out"
            )

    def _sequence_regions(self, model: nn.Module, plan: Plan) -> None:
        """The residual stream between the blocks' split layers holds this rank's chunk of the sequence:
        cut at the first block's input, put together at the last block's output.  The whole-kept
        parameters inside (norms) see a chunk each: their gradients are summed over the group."""
        blocks = _blocks(model, plan)
        assert blocks is not None
        group = self.group

        def cut(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            x = args[0] if args else next(iter(kwargs.values()))
            if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[1] % self.size:
                raise ParallelxError(
                    f"--sequence-parallel cuts the blocks' input along the sequence (dim 1) into {self.size} equal "
                    f"chunks: the first block got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}; "
                    f"give sequences whose length {self.size} divides, or leave --sequence-parallel out"
                )
            if args:
                return (comm.split_sequence(args[0], group), *args[1:]), kwargs
            key = next(iter(kwargs))
            return args, {**kwargs, key: comm.split_sequence(kwargs[key], group)}

        def join(module: nn.Module, args: Any, output: Any) -> Any:
            if isinstance(output, torch.Tensor):
                return comm.join_sequence(output, group)
            if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
                return (comm.join_sequence(output[0], group), *output[1:])
            raise ParallelxError("--sequence-parallel: the last block returns neither a tensor nor a tuple led by one")

        def gather(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if args:
                return (comm.gather_sequence(args[0], group), *args[1:]), kwargs
            key = next(iter(kwargs))
            return args, {**kwargs, key: comm.gather_sequence(kwargs[key], group)}

        blocks[0].register_forward_pre_hook(cut, with_kwargs=True)
        blocks[-1].register_forward_hook(join)
        # Each module holding column-wise layers (the attention, the MLP) reads the whole sequence.
        # (nanoGPT keeps its MLP's layers straight in the block, whose input is the residual stream: there
        # each column-wise layer gathers its own input.)
        modules = dict(model.named_modules())
        in_blocks = {id(b) for b in blocks}
        colwise = {n: s for n, s in plan.splits.items() if s.style == "colwise" and s.in_blocks}
        for owner in sorted({n.rpartition(".")[0] for n in colwise}):
            if id(modules[owner]) in in_blocks:
                for n in colwise:
                    if n.rpartition(".")[0] == owner:
                        modules[n].gathers = True
            else:
                modules[owner].register_forward_pre_hook(gather, with_kwargs=True)
        prefix = next(n for n, m in model.named_modules() if m is blocks)
        layouts = self._layouts.get(model, {})
        self._partial[model] = {
            f"{prefix}.{n}" for n, p in blocks.named_parameters() if p.requires_grad and f"{prefix}.{n}" not in layouts
        }

    def finish_gradients(self, optimizer: Any) -> None:
        """Under sequence parallelism, at the window's end and before clipping: the whole-kept parameters
        between the split layers (norms, a row-wise layer's bias) saw one chunk of the sequence on each
        rank, so their gradients are summed over the group (one all-reduce for all of them)."""
        grads = [
            p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            for group in optimizer.param_groups
            for p in group["params"]
            if id(p) in self._partial_ids and p.grad is not None
        ]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    # ------------------------------------------------------------ state and norms
    def gather_state(self, model: nn.Module, state: Mapping[str, Any]) -> dict[str, Any]:
        """``state`` (a model's, by plain names) with every split tensor put together whole.  A collective
        over the tensor-parallel group: every rank calls it."""
        layouts = self.layouts(model)
        out = dict(state)
        for name, layout in layouts.items():
            if name in out and isinstance(out[name], torch.Tensor):
                out[name] = self.gather(out[name], layout)
        return out

    def gather(self, local: torch.Tensor, layout: Layout) -> torch.Tensor:
        t = local.detach()
        device = t.device
        # Gloo moves CPU tensors, NCCL this process's GPU's.
        wire = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" else None
        t = t.to(wire or "cpu")
        parts = [torch.empty_like(t.contiguous()) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return whole_from_slices(parts, layout.dim, layout.parts).to(device)

    def whole_gradients(self, pairs: list[tuple[str, torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """``(name, parameter, gradient)`` as ``{name: whole gradient}``: a split parameter's slices put
        together over the group (the ranks hold the same parameters in the same order: every rank
        calls it, a collective), the others as they are."""
        out = {}
        for name, param, grad in pairs:
            layout = self._layout_ids.get(id(param))
            out[name] = grad if layout is None else self.gather(grad, layout)
        return out

    def slice_state(self, model: nn.Module, state: Mapping[str, Any]) -> dict[str, Any]:
        """Whole tensors of ``state`` cut to this rank's slices (no communication)."""
        out = dict(state)
        for name, layout in self.layouts(model).items():
            value = out.get(name)
            if isinstance(value, torch.Tensor) and value.dim() > layout.dim:
                out[name] = local_slice(value, layout.dim, layout.parts, self.mesh.tp_rank, self.size).clone()
        return out

    def whole_shape(self, model: nn.Module, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        layout = self.layouts(model).get(name)
        if layout is None:
            return shape
        whole = list(shape)
        whole[layout.dim] *= self.size
        return tuple(whole)

    def combine_norms(self, per_param: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
        """The global 2-norm from each parameter's norm as this rank's data-parallel group holds it: a
        split parameter's squares summed over the tensor-parallel group, a whole one's counted once."""
        sq = per_param.double() ** 2
        split = torch.tensor([self.is_split(p) for p in params], dtype=torch.bool, device=sq.device)
        pair = torch.stack([sq[split].sum(), sq[~split].sum()])
        summed = pair.clone()
        dist.all_reduce(summed, group=self.group)
        return (summed[0] + pair[1]).sqrt().to(per_param.dtype)

    def total_norm(self, params: Iterable[torch.Tensor]) -> torch.Tensor:
        """The global 2-norm of the gradients: a split gradient's squares summed over the group, a whole
        one's counted once (float64 sums; equal to one process's but for the order of additions)."""
        grads = [(p.grad, self.is_split(p)) for p in params if p.grad is not None]
        if not grads:
            return torch.zeros(())
        dtype, device = grads[0][0].dtype, grads[0][0].device
        split = torch.zeros((), dtype=torch.float64, device=device)
        whole = torch.zeros((), dtype=torch.float64, device=device)
        for g, is_split in grads:
            sq = torch.linalg.vector_norm(g.detach(), 2.0).double() ** 2
            if is_split:
                split = split + sq
            else:
                whole = whole + sq
        dist.all_reduce(split, group=self.group)
        return (split + whole).sqrt().to(dtype)


def _blocks(model: nn.Module, plan: Plan) -> nn.ModuleList | None:
    """The model's list of blocks: an ``nn.ModuleList`` under which every split layer lives."""
    inside = [n for n, s in plan.splits.items() if s.in_blocks]
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and all(s.startswith(f"{name}.") for s in inside):
            return module
    return None
