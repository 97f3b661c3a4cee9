"""The plan: which layers split how, found and checked before anything changes.

A plan maps module names to a style:

- ``colwise``: an ``nn.Linear``'s output features split over the ranks (its
  weight's rows and its bias); it reads the whole input.
- ``rowwise``: an ``nn.Linear``'s input features split (its weight's columns);
  the partial products are summed over the ranks, the bias added once.
- ``replicate``: kept whole on every rank (the default for what the plan does not name).

Where the plan comes from, first found: ``tp_plan=`` (``--tensor-parallel``'s
caller's own, patterns as ``transformers`` writes them: ``"layers.*.self_attn.q_proj":
"colwise"``, ``*`` one name), the model's ``tp_plan`` attribute (a dict of the same
form), else the default plan for the shapes users train: in each module that holds
attention projections, ``q/k/v`` (and their other spellings) column-wise and the
output projection row-wise; a fused ``c_attn`` (nanoGPT's q, k and v in one layer)
column-wise by heads, each rank holding its heads' q, k and v; in each MLP the
up/gate projections column-wise and the down projection row-wise.  Embeddings and the
output head stay whole (vocabulary-parallel is not offered: said in the plan's line).

A model the plan cannot split exactly is refused before anything changes: heads
that the ranks cannot share equally, a layer of a kind it does not know
(``transformers``' GPT-2 ``Conv1D``) where the plan would split, an attention
module whose head count it cannot read.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping

from torch import nn

from parallelx.errors import ParallelxError

__all__ = ["Plan", "Split", "find_plan", "split_shares"]

STYLES = ("colwise", "rowwise", "replicate", "colwise_rep", "vocab")
# transformers' tp_plan values that keep a layer whole here (what they do needs DTensor layouts or
# vocabulary-parallel losses): said in the plan's line.
_KEPT_WHOLE = {
    "local_colwise",
    "local_rowwise",
    "local",
    "gather",
    "replicated_with_grad_allreduce",
    "local_packed_rowwise",
    "sequence_parallel",
    "isolated",
    "ep_router",
    "grouped_gemm",
}

# The default plan's names: an attention module's projections, an MLP's layers.
_ATTN_COLWISE = {"q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv", "q", "k", "v"}
_ATTN_ROWWISE = {"o_proj", "out_proj", "wo", "c_proj", "dense", "proj", "o"}
_FUSED_QKV = {"c_attn", "qkv", "qkv_proj", "Wqkv", "query_key_value", "in_proj"}
_TOKEN_EMBEDDINGS = {"wte", "embed_tokens", "tok_embeddings", "word_embeddings", "embed", "embedding", "tok_emb"}
_HEADS = {"lm_head", "output", "head"}
_MLP_COLWISE = {"c_fc", "fc1", "up_proj", "gate_proj", "w1", "w3", "fc_in", "w_in"}
_MLP_ROWWISE = {"c_proj", "fc2", "down_proj", "w2", "fc_out", "w_out"}
#: Attributes of an attention module that count heads: divided by the ranks.
HEAD_ATTRS = (
    "n_head",
    "num_heads",
    "n_heads",
    "num_attention_heads",
    "num_key_value_heads",
    "n_kv_heads",
    "n_kv_head",
    "num_kv_heads",
    "n_local_heads",
    "n_local_kv_heads",
)


@dataclasses.dataclass(frozen=True)
class Split:
    """One split layer: its style; ``parts`` for a fused layer (q, k and v in one weight: each part split alike).

    ``colwise`` with ``gather``: the output head (vocabulary shards of the logits, put together whole for
    the script's loss, exactly); ``vocab``: an ``nn.Embedding`` whose rows (the vocabulary) are split."""

    style: str
    parts: int = 1
    gather: bool = False

    @property
    def in_blocks(self) -> bool:
        """A layer of a block (attention, MLP), not the embedding or the output head."""
        return self.style in ("colwise", "rowwise") and not self.gather


@dataclasses.dataclass
class Plan:
    """The layers to split (by module name), the attention modules whose head counts become per-rank,
    the fused attention modules whose forward runs on this rank's heads, and what stays whole."""

    splits: dict[str, Split]
    attention: dict[str, dict[str, int]]  # module name -> {head attribute: whole count}
    fused_attention: list[str]
    kept_whole: list[str]
    source: str

    def describe(self, tp: int) -> str:
        col = sum(s.style == "colwise" and not s.gather for s in self.splits.values())
        row = sum(s.style == "rowwise" for s in self.splits.values())
        vocab = sorted(n for n, s in self.splits.items() if s.style == "vocab" or s.gather)
        heads = sorted({f"{k} {v} -> {v // tp}" for attrs in self.attention.values() for k, v in attrs.items()})
        line = f"tensor parallel {tp} ({self.source}): {col} layers column-wise, {row} row-wise"
        if heads:
            line += f"; per rank: {', '.join(heads)}"
        if self.fused_attention:
            line += f"; fused q/k/v split by heads in {len(self.fused_attention)} attention modules"
        if vocab:
            line += f"; vocabulary split: {', '.join(vocab)}"
        if self.kept_whole:
            line += f"; kept whole: {', '.join(self.kept_whole[:4])}{' ...' if len(self.kept_whole) > 4 else ''}"
        return line


def _match(pattern: str, name: str) -> bool:
    # transformers' form: "*" stands for one name (a layer index); fnmatch's also crosses dots.
    return len(pattern.split(".")) == len(name.split(".")) and fnmatch.fnmatchcase(name, pattern)


def find_plan(model: nn.Module, tp: int, given: Mapping[str, str] | None = None) -> Plan:
    """The plan for ``model`` at ``tp`` ranks, checked; raises :class:`ParallelxError` naming what
    cannot be split (nothing is changed here)."""
    modules = dict(model.named_modules())
    own = getattr(model, "tp_plan", None)
    if given:
        plan, source = _from_patterns(modules, given, "the given tp_plan"), "the given tp_plan"
    elif isinstance(own, Mapping) and own:
        plan, source = _from_patterns(modules, own, f"{type(model).__name__}.tp_plan"), "the model's tp_plan"
    else:
        plan, source = _default(modules, tp), "the default plan"
    splits, kept = plan
    if not any(s.in_blocks and s.style == "colwise" for s in splits.values()):
        raise ParallelxError(
            f"--tensor-parallel {tp}: {source} splits no layer of {type(model).__name__}: it finds attention "
            f"projections (q_proj/k_proj/v_proj/o_proj, a fused c_attn with c_proj) and MLPs (c_fc/c_proj, "
            f"up_proj/gate_proj/down_proj, fc1/fc2, w1/w2/w3) by name; give the model a tp_plan "
            "({'blocks.*.mlp.fc1': 'colwise', 'blocks.*.mlp.fc2': 'rowwise', ...}) or pass tp_plan="
        )
    for name, split in splits.items():
        _check_layer(name, modules[name], split, tp)
    attention, fused = _attention(modules, splits, tp)
    return Plan(splits, attention, fused, kept, source)


def _from_patterns(
    modules: Mapping[str, nn.Module], patterns: Mapping[str, str], source: str
) -> tuple[dict[str, Split], list[str]]:
    splits: dict[str, Split] = {}
    kept: list[str] = []
    for pattern, style in patterns.items():
        hits = [n for n in modules if n and _match(pattern, n)]
        if not hits:
            raise ParallelxError(f"--tensor-parallel: {source}'s {pattern!r} names no module of the model")
        if style in _KEPT_WHOLE or style == "replicate":
            kept.append(pattern)
            continue
        if style not in STYLES:
            raise ParallelxError(
                f"--tensor-parallel: {source}'s {pattern!r}: {style!r} is not a style parallelx applies; "
                f"give one of {', '.join(STYLES)}"
            )
        for n in hits:
            base = n.rsplit(".", 1)[-1]
            if isinstance(modules[n], nn.Embedding) and style in ("rowwise", "vocab"):
                splits[n] = Split("vocab")  # transformers' "rowwise" embedding: its vocabulary split
            elif style == "colwise_rep":  # transformers' head: colwise, the output gathered
                splits[n] = Split("colwise", gather=True)
            else:
                parts = 3 if style == "colwise" and base in _FUSED_QKV and _fused(modules[n]) else 1
                splits[n] = Split(style, parts)
    return splits, kept


def _fused(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and module.out_features == 3 * module.in_features


def _default(modules: Mapping[str, nn.Module], tp: int) -> tuple[dict[str, Split], list[str]]:
    splits: dict[str, Split] = {}
    kept: list[str] = []
    for parent_name, parent in modules.items():
        children = dict(parent.named_children())
        full = {n: f"{parent_name}.{n}" if parent_name else n for n in children}
        has_attention = bool(_ATTN_COLWISE & children.keys()) or any(
            n in _FUSED_QKV and _fused(children[n]) for n in children
        )
        has_mlp = bool(_MLP_COLWISE & children.keys())
        if has_attention:
            for n in children:
                if n in _ATTN_COLWISE:
                    splits[full[n]] = Split("colwise")
                elif n in _FUSED_QKV and _fused(children[n]):
                    splits[full[n]] = Split("colwise", parts=3)
                elif n in _ATTN_ROWWISE:
                    splits[full[n]] = Split("rowwise")
        elif has_mlp:
            for n in children:
                if n in _MLP_COLWISE:
                    splits[full[n]] = Split("colwise")
                elif n in _MLP_ROWWISE:
                    splits[full[n]] = Split("rowwise")
    # The token embedding and the output head (often one tied tensor, the largest of the model): their
    # vocabulary split, where the ranks can share it equally; kept whole otherwise (said in the plan's line).
    for name, module in modules.items():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Embedding) and leaf in _TOKEN_EMBEDDINGS:
            ok = module.num_embeddings % tp == 0 and module.padding_idx is None and module.max_norm is None
            if ok and not module.sparse:
                splits[name] = Split("vocab")
            else:
                kept.append(name)
        elif type(module) is nn.Linear and leaf in _HEADS:
            if module.out_features % tp == 0:
                splits[name] = Split("colwise", gather=True)
            else:
                kept.append(name)
        elif isinstance(module, nn.Embedding):
            kept.append(name)
    return splits, kept


def _check_layer(name: str, module: nn.Module, split: Split, tp: int) -> None:
    kind = type(module).__name__
    if split.style == "vocab":
        if type(module) is not nn.Embedding:
            raise ParallelxError(
                f"--tensor-parallel {tp}: {name} is a {kind}: a vocabulary split takes an nn.Embedding"
            )
        if module.padding_idx is not None or module.max_norm is not None or module.sparse:
            raise ParallelxError(
                f"--tensor-parallel {tp}: {name} has a padding_idx, max_norm or sparse gradients, which a split "
                f"vocabulary does not keep: keep it whole with tp_plan={{{name!r}: 'replicate', ...}}"
            )
        if module.num_embeddings % tp:
            raise ParallelxError(
                f"--tensor-parallel {tp}: {name} has {module.num_embeddings} rows, which {tp} ranks cannot share "
                f"equally: pad the vocabulary to a multiple of {tp}, or keep it whole"
            )
        return
    if type(module) is not nn.Linear:
        hint = (
            " (transformers' GPT-2 keeps its weights transposed in Conv1D: load it as a model whose layers are "
            "nn.Linear, or leave --tensor-parallel out)"
            if kind == "Conv1D"
            else ""
        )
        raise ParallelxError(
            f"--tensor-parallel {tp}: {name} is a {kind}, not an nn.Linear: parallelx splits nn.Linear layers "
            f"only{hint}; keep it whole with tp_plan={{{name!r}: 'replicate', ...}}"
        )
    size = module.out_features // split.parts if split.style == "colwise" else module.in_features
    if size % tp:
        dim = "output" if split.style == "colwise" else "input"
        raise ParallelxError(
            f"--tensor-parallel {tp}: {name} ({split.style}) has {size} {dim} features"
            f"{' per part' if split.parts > 1 else ''}, which {tp} ranks cannot share equally: "
            f"give a --tensor-parallel that divides {size}"
        )


def _attention(
    modules: Mapping[str, nn.Module], splits: Mapping[str, Split], tp: int
) -> tuple[dict[str, dict[str, int]], list[str]]:
    """The attention modules (parents of column-wise projections that feed heads), their head counts
    checked against ``tp``; the fused ones listed for their per-rank forward."""
    attention: dict[str, dict[str, int]] = {}
    fused: list[str] = []
    for name, split in splits.items():
        if split.style != "colwise":
            continue
        parent_name, _, leaf = name.rpartition(".")
        if leaf not in _ATTN_COLWISE and leaf not in _FUSED_QKV:
            continue
        parent = modules[parent_name]
        heads = {a: v for a in HEAD_ATTRS if isinstance(v := getattr(parent, a, None), int) and not isinstance(v, bool)}
        head_dim = getattr(parent, "head_dim", None)
        layer = modules[name]
        assert isinstance(layer, nn.Linear)
        if isinstance(head_dim, int) and head_dim > 0:  # each projection's heads (grouped-query: fewer k, v)
            count = layer.out_features // split.parts // head_dim
            if count % tp:
                raise ParallelxError(
                    f"--tensor-parallel {tp}: {name} holds {count} heads of {head_dim}, which {tp} ranks cannot "
                    f"share equally: give a --tensor-parallel that divides {count}"
                )
        if parent_name in attention:
            continue
        if not heads and not (isinstance(head_dim, int) and head_dim > 0):
            raise ParallelxError(
                f"--tensor-parallel {tp}: the attention module {parent_name} ({type(parent).__name__}) keeps "
                f"neither a head count ({', '.join(HEAD_ATTRS[:3])}, ...) nor a head_dim, so its heads cannot be "
                "shared out without splitting one: give it one of those attributes, or keep it whole with "
                f"tp_plan={{{(parent_name + '.*')!r}: 'replicate', ...}}"
            )
        for attr, count in heads.items():
            if count % tp:
                raise ParallelxError(
                    f"--tensor-parallel {tp}: {parent_name}.{attr} is {count}, which {tp} ranks cannot share "
                    f"equally: give a --tensor-parallel that divides {count}"
                )
        attention[parent_name] = heads
        if split.parts > 1:
            if not hasattr(parent, "c_proj") or "n_head" not in heads:
                raise ParallelxError(
                    f"--tensor-parallel {tp}: {name} holds q, k and v in one layer; parallelx splits that by heads "
                    f"in nanoGPT's form of attention (c_attn, c_proj, n_head, causal): {parent_name} "
                    f"({type(parent).__name__}) is not that form: give it separate q_proj/k_proj/v_proj layers, "
                    f"or keep it whole with tp_plan={{{(parent_name + '.*')!r}: 'replicate', ...}}"
                )
            fused.append(parent_name)
    return attention, fused


def split_shares(model: nn.Module, plan: Plan, tp: int) -> dict[int, int]:
    """Each split parameter (by ``id``) -> ``tp``, the ranks that share it: what the memory estimate
    divides (:func:`parallelx.bigmodels.estimate.count_model`)."""
    modules = dict(model.named_modules())
    shares: dict[int, int] = {}
    for name, split in plan.splits.items():
        layer = modules[name]
        shares[id(layer.weight)] = tp
        bias = getattr(layer, "bias", None)
        if bias is not None and split.style == "colwise":
            shares[id(bias)] = tp
    return shares
