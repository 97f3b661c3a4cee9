"""Tensor parallelism under a real launcher: each model trained through parallelx at
``--tensor-parallel N`` and, in the same process, by plain PyTorch on one process
(the reference), and a second reference whose micro-batches are summed in another
order (the floor of summation order).  Writes ``report-<rank>.json``:
per model the largest relative difference per tensor against the reference and
the floor's, the losses, and the checkpoint moves.

    torchrun --nproc-per-node 4 tests/support/tp_worker.py --backend fsdp --tensor-parallel 2 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import parallelx

STEPS, ACCUMULATE, CLIP, GLOBAL_BATCH, T, VOCAB = 3, 2, 0.05, 8, 16, 64


# ------------------------------------------------------------------ the models
def recipe_gpt() -> nn.Module:
    from recipes.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=2, n_head=4, n_embd=32, dropout=0.0))


def nanogpt() -> nn.Module:
    sys.path.insert(0, str(Path(__file__).resolve().parent / "check_scripts"))
    import nanogpt_port as ng

    return ng.GPT(ng.GPTConfig(block_size=T, vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32, dropout=0.0))


class LlamaLM(nn.Module):
    """transformers' Llama (RoPE, RMSNorm, SwiGLU, grouped-query attention) built from a config; the
    forward gives the logits as the other models do."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=T,
            tie_word_embeddings=False,
            attn_implementation="sdpa",
        )
        self.inner = LlamaForCausalLM(config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=idx).logits


MODELS = {"recipe_gpt": recipe_gpt, "nanogpt": nanogpt, "llama": LlamaLM}


def groups(model: nn.Module) -> list[dict[str, Any]]:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def data(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS * ACCUMULATE):
        x = torch.randint(0, VOCAB, (GLOBAL_BATCH, T), generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    if isinstance(logits, tuple):  # nanoGPT's (logits, loss)
        logits = logits[0]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def reference(
    build: Any, batches: list[Any], pieces: int, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """One process on the global batch, each micro-batch's gradient taken in ``pieces`` parts."""
    torch.manual_seed(0)
    model = build().to(dtype)
    opt = torch.optim.AdamW(groups(model), lr=1e-2)
    for i, (x, y) in enumerate(batches):
        for xs, ys in zip(x.chunk(pieces), y.chunk(pieces)):
            (loss_of(model, xs, ys) / (ACCUMULATE * pieces)).backward()
        if (i + 1) % ACCUMULATE == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def full_logits(logits: torch.Tensor) -> torch.Tensor:
    """The logits whole (under --loss-parallel a DTensor of vocabulary shards: only the loss takes those)."""
    return logits.full_tensor() if hasattr(logits, "full_tensor") else logits


def per_tensor(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each tensor's largest difference relative to its largest value."""
    return {k: float((v - b[k].to(v.dtype)).abs().max()) / (float(v.abs().max()) or 1.0) for k, v in a.items()}


def rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(per_tensor(a, b).values())


def mine(backend: parallelx.Backend, batches: list[Any]) -> list[Any]:
    """This data-parallel rank's rows of each global batch (the tensor-parallel peers read the same)."""
    m = backend.mesh
    return [(x.chunk(m.data_size)[m.data_rank], y.chunk(m.data_size)[m.data_rank]) for x, y in batches]


def train(backend: parallelx.Backend, build: Any, batches: list[Any]) -> tuple[nn.Module, Any, list[float]]:
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.AdamW(groups(model), lr=1e-2)
    model, opt = backend.setup(model, opt)
    losses = []
    for x, y in backend.batches(mine(backend, batches)):
        loss = loss_of(model, x, y)
        backend.backward(loss)
        out = backend.step(opt)
        if out is not None:
            losses.append(float(loss))
    return model, opt, losses


def everything_else(backend: parallelx.Backend, out: Path) -> dict[str, Any]:
    """The rest of a script under tensor parallelism: a weight average, save_pretrained read back by
    transformers, the sampler, gathering in dataset order and MetricSums counting each sample once."""
    seen: dict[str, Any] = {}
    torch.manual_seed(0)
    model = LlamaLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = backend.setup(model, opt)
    ema = parallelx.EMA(backend, model, decay=0.5)
    for x, y in backend.batches(mine(backend, data(3)[:ACCUMULATE])):
        backend.backward(loss_of(model, x, y))
        if backend.step(opt) is not None:
            ema.update()
    whole = backend.model_state_dict(model)
    averaged = ema.model_state_dict()
    seen["ema_whole"] = all(tuple(averaged[k].shape) == tuple(v.shape) for k, v in whole.items() if k in averaged)
    folder = out / "pretrained"
    inner = backend.unwrap(model).inner
    parallelx.save_pretrained(backend, inner, folder)
    x = data(4)[0][0][:2]
    with torch.no_grad():
        ours = full_logits(model(x))
    if backend.rank == 0:
        from transformers import LlamaForCausalLM

        with torch.no_grad():
            theirs = LlamaForCausalLM.from_pretrained(folder).eval()(input_ids=x).logits
        seen["pretrained_logits"] = float((theirs - ours).abs().max() / ours.abs().max())
    # The same folder read straight into the split layers of a model built on the meta device: each rank
    # reads only the slices it keeps (the rows, or a row-wise layer's columns), the logits are the same.
    with parallelx.init_module():
        built = LlamaLM()
    weights = parallelx.load_pretrained(built.inner, folder)
    built = backend.wrap_model(built)
    held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.dtype.itemsize for p in built.parameters())
    with torch.no_grad():
        seen["pretrained_into_slices"] = {
            "equal_logits": torch.equal(full_logits(built(x)), ours),
            "bytes_read": weights.bytes_read,
            "bytes_held": held,
            "file_bytes": weights.total_bytes(),
        }
    # Every model built on the meta device equals its eager build, each rank computing only its slices.
    seen["meta_equal_eager"] = {}
    for name, build in MODELS.items():
        torch.manual_seed(0)
        eager = backend.wrap_model(build())
        torch.manual_seed(0)
        with parallelx.init_module():
            lazy = build()
        lazy = backend.wrap_model(lazy)
        a, b = backend.model_state_dict(eager), backend.model_state_dict(lazy)
        seen["meta_equal_eager"][name] = [k for k in a if not torch.equal(a[k], b[k])]
    dataset = torch.utils.data.TensorDataset(torch.arange(11.0))
    sampler = backend.make_sampler(dataset, shuffle=True, seed=3)
    order = list(sampler)  # one pass (each pass shuffles anew)
    mine_rows = torch.tensor([float(i) for i in order])
    seen["sampler"] = [int(i) for i in order]
    seen["gathered_in_order"] = backend.gather_in_order(mine_rows, sampler).tolist() == list(range(11))
    sums = parallelx.MetricSums(sampler)  # the padding masked by position
    sums.update(mine_rows, None)
    seen["metric_count"] = sums.compute(backend)["count"]
    return seen


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--resume-from", type=Path, default=None, help="a checkpoint folder another launch wrote")
    parallelx.add_arguments(parser)
    args = parser.parse_args()
    backend = parallelx.from_args(args, accumulate=ACCUMULATE, clip_grad_norm=CLIP)
    report: dict[str, Any] = {}
    with backend:
        report["mesh"] = {
            "data_rank": backend.mesh.data_rank,
            "data_size": backend.mesh.data_size,
            "tp_rank": backend.mesh.tp_rank,
            "tp_size": backend.mesh.tp_size,
        }
        for name in args.models.split(","):
            batches = data(1)
            ref = reference(MODELS[name], batches, 1)
            # The floor of summation order: the same run with the batch's sums in other orders, and in
            # float64 (how far float32's rounding alone moves these weights).
            floors = [reference(MODELS[name], batches, 2), reference(MODELS[name], batches, 4)]
            floors.append(reference(MODELS[name], batches, 1, torch.float64))
            model, opt, losses = train(backend, MODELS[name], batches)
            whole = backend.model_state_dict(model)
            entry: dict[str, Any] = {
                "diff": rel(ref, whole),
                "floor": max(rel(ref, f) for f in floors),
                "floors": [rel(ref, f) for f in floors],
                "worst": sorted(per_tensor(ref, whole).items(), key=lambda kv: -kv[1])[:3],
                "worst_floor": sorted(per_tensor(ref, floors[0]).items(), key=lambda kv: -kv[1])[:3],
                "losses": losses,
            }
            entry["shapes_whole"] = all(tuple(whole[k].shape) == tuple(v.shape) for k, v in ref.items())
            # The checkpoint: written here, resumed here and by the other launch (any degree, any backend).
            ckpt = args.out / f"ckpt-{name}.pt"
            backend.save({"model": model, "optimizer": opt, "named": backend.named_optimizer_state(model, opt)}, ckpt)
            if args.resume_from is not None and (args.resume_from / f"ckpt-{name}.pt").exists():
                saved = backend.load(args.resume_from / f"ckpt-{name}.pt")
                torch.manual_seed(0)
                fresh = MODELS[name]()
                fresh_opt = torch.optim.AdamW(groups(fresh), lr=1e-2)
                fresh, fresh_opt = backend.setup(fresh, fresh_opt)
                backend.load_state_dict(fresh, saved["model"])
                backend.load_named_optimizer_state(fresh, fresh_opt, saved["named"])
                # Both continue one more window on the same data: the resumed equals the uninterrupted.
                more = mine(backend, data(2)[:ACCUMULATE])
                for m, o in ((model, opt), (fresh, fresh_opt)):
                    for x, y in backend.batches(more):
                        backend.backward(loss_of(m, x, y))
                        backend.step(o)
                a, b = backend.model_state_dict(model), backend.model_state_dict(fresh)
                entry["resumed_vs_uninterrupted"] = rel(a, b)
                entry["resumed_vs_saved_run"] = rel(saved["model"], whole)
            report[name] = entry
        if backend.mesh.tp_size > 1:
            report["everything_else"] = everything_else(backend, args.out)
        # A loader keyed by backend.rank gives the peers of a tensor-parallel group different batches.
        if backend.mesh.tp_size > 1:
            torch.manual_seed(0)
            model = backend.wrap_model(MODELS["recipe_gpt"]())
            x = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(backend.rank))
            try:
                model(x)
                report["peers_caught"] = None
            except parallelx.ParallelxError as exc:
                report["peers_caught"] = str(exc)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"report-{int(os.environ.get('RANK', '0'))}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
