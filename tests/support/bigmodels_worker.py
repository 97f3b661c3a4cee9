"""Run under a real launcher (2 processes): models bigger than one rank, on one backend.

Sections (``--cases``):

- ``meta``: models built under ``parallelx.init_module()`` against the same models built eagerly from
  the same seed, both set up on this backend with an AdamW built before set-up: the whole state
  (``backend.model_state_dict``) and the non-persistent buffers equal **bitwise**, tied weights still
  one parameter, the random stream after the build the eager one, and after one training step the
  weights still bitwise equal.  Models: the suite's nanoGPT-style GPT (``gpt.GPT``: tied embedding,
  ``model.apply(_init)``, a scaled ``c_proj`` init over ``named_parameters``, a scalar and a frozen
  parameter) and ``RotaryNet`` (a rotary ``inv_freq`` made in ``__init__``, non-persistent; a
  ``nn.Parameter(torch.randn(...))``; a BatchNorm's buffers).
- ``plain``: models built under plain ``torch.device("meta")``: torch.nn's layers only, given their values
  by their modules' ``reset_parameters`` and, with ``parallelx.init_weights``, the model's own init,
  equal **bitwise** to the eager builds as above; a model whose ``__init__`` makes values no reset gives
  (a rotary ``inv_freq``, ``nn.Parameter(torch.randn(...))``) is refused with a ``ParallelxError`` naming
  them and ``parallelx.init_module()`` (not torch's ``Cannot copy out of meta tensor``).

- ``setup``: what set-up leaves for the first step (``case_setup``): under ZeRO-3 the engine waits for
  the first forward, a scheduler and a one-rank read of the learning rate build nothing, and ZeRO-3's
  float32 partitions are its masters.

Every rank writes ``<out>/rank<r>.json``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gpt import GPT, Config, tokens
from torch import nn
from worker_cases import Case, run_cases

import parallelx
from parallelx.errors import ParallelxError

CFG = Config(vocab=48, block=16, layers=2, heads=2, width=32)


class Rotary(nn.Module):
    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = torch.outer(torch.arange(x.shape[1], dtype=torch.float32, device=x.device), self.inv_freq)
        return x * torch.cos(f).repeat(1, 2)[None]


class RotaryNet(nn.Module):
    def __init__(self, vocab: int = 48, width: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.rot = Rotary(width)
        self.gain = nn.Parameter(torch.randn(width) * 0.1 + 1.0)
        self.fc = nn.Linear(width, 4 * width)
        self.norm = nn.BatchNorm1d(4 * width)
        self.out = nn.Linear(4 * width, vocab)
        nn.init.trunc_normal_(self.fc.weight, std=0.02)
        nn.init.kaiming_normal_(self.out.weight)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.rot(self.emb(idx)) * self.gain
        h = self.fc(x)
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        logits = self.out(torch.relu(h))
        loss = None if targets is None else nn.functional.cross_entropy(logits.flatten(0, 1), targets.reshape(-1))
        return logits, loss


MODELS: dict[str, Callable[[], nn.Module]] = {"gpt": lambda: GPT(CFG), "rotary": RotaryNet}


def mismatched(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    names = sorted(set(a) | set(b))
    return [n for n in names if n not in a or n not in b or not torch.equal(a[n], b[n])]


def train_step(backend: parallelx.Backend, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x, y = tokens(backend.rank, 0, 4, CFG)
    _, loss = model(x.to(backend.device), y.to(backend.device))
    backend.backward(loss)
    backend.step(optimizer)


class PlainNet(nn.Module):
    """torch.nn's layers only (an attention's ``_reset_parameters``, LayerNorm, BatchNorm, a tied head),
    and with ``init`` a nanoGPT-style ``init_weights`` after them: what a plain ``torch.device("meta")``
    build recomputes from ``reset_parameters`` (and ``parallelx.init_weights``)."""

    def __init__(self, vocab: int = 48, width: int = 32, init: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.layer = nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.0, batch_first=True)
        self.norm = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, vocab)
        # Tied as nanoGPT ties: the later module's tensor kept (a plain meta build's tied tensor takes
        # the last reset's values, docs/big-models.md).
        self.emb.weight = self.head.weight
        if init:
            self.init_weights()

    def init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, 0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = self.layer(self.emb(idx))
        logits = self.head(self.norm(h.transpose(1, 2)).transpose(1, 2))
        loss = None if targets is None else nn.functional.cross_entropy(logits.flatten(0, 1), targets.reshape(-1))
        return logits, loss


def compare(
    backend: parallelx.Backend,
    eager: nn.Module,
    meta: nn.Module,
    after_eager: torch.Tensor,
    after_meta: torch.Tensor | None,
) -> dict[str, Any]:
    """Both models set up with an AdamW built before set-up, compared bitwise there and after one step;
    the random numbers drawn after each build (``after_meta`` None: after the meta model's set-up)."""
    on_meta = all(t.is_meta for t in [*meta.parameters(), *meta.buffers()])
    models = []
    for m in (eager, meta):
        params = [p for p in m.parameters() if p.requires_grad]
        models.append(backend.setup(m, torch.optim.AdamW(params, lr=1e-2)))
    if after_meta is None:
        after_meta = torch.rand(4)
    (we, oe), (wm, om) = models
    states = [backend.model_state_dict(w) for w in (we, wm)]
    ue, um = backend.unwrap(we), backend.unwrap(wm)
    buffers = [{n: b.detach().cpu().clone() for n, b in u.named_buffers()} for u in (ue, um)]
    tied = None
    if hasattr(um, "lm_head"):
        tied = [u.transformer.wte.weight is u.lm_head.weight for u in (ue, um)]
    elif hasattr(um, "head"):
        tied = [u.emb.weight is u.head.weight for u in (ue, um)]
    for w, o in ((we, oe), (wm, om)):
        w.train()
        train_step(backend, w, o)  # type: ignore[arg-type]
    stepped = [backend.model_state_dict(w) for w in (we, wm)]
    return {
        "built_on_meta": on_meta,
        "rng_after_build_equal": torch.equal(after_eager, after_meta),
        "tensors": len(states[0]),
        "mismatched": mismatched(*states),
        "buffers_mismatched": mismatched(*buffers),
        "buffers": sorted(buffers[1]),
        "tied": tied,
        "after_step_mismatched": mismatched(*stepped),
        "step_changed": not all(torch.equal(states[0][k], stepped[0][k]) for k in states[0]),
    }


def case_meta(backend: parallelx.Backend) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, make in MODELS.items():
        torch.manual_seed(0)
        eager = make()
        after_eager = torch.rand(4)
        torch.manual_seed(0)
        with parallelx.init_module():
            meta = make()
        out[name] = compare(backend, eager, meta, after_eager, torch.rand(4))
    return out


def case_plain(backend: parallelx.Backend) -> dict[str, Any]:
    """Plain ``torch.device("meta")`` builds: the modules' ``reset_parameters`` (``reset``), and with the
    model's own ``init_weights`` given to ``parallelx.init_weights`` (``init``), against eager builds
    from the same seed; the random stream after set-up is compared with the eager build's (set-up
    draws what the build did not).  A model whose ``__init__`` makes values no reset gives is
    refused, naming them."""
    out: dict[str, Any] = {}
    for name, init in (("reset", False), ("init", True)):
        torch.manual_seed(0)
        eager = PlainNet(init=init)
        after_eager = torch.rand(4)
        torch.manual_seed(0)
        with torch.device("meta"):
            meta = PlainNet(init=init)
        if init:
            parallelx.init_weights(meta, PlainNet.init_weights)
        out[name] = compare(backend, eager, meta, after_eager, None)
    with torch.device("meta"):
        model = RotaryNet()
    try:
        backend.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    except ParallelxError as exc:
        out["refused"] = str(exc)
    except Exception as exc:  # torch's own error: what this case guards against
        out["other"] = f"{type(exc).__name__}: {exc}"
    return out


def write_files(directory: Path) -> dict[str, Path]:
    """The weights of a GPT built from seed 1 in each format (the set-ups build from seed 0, so a
    weight that did not load shows)."""
    from safetensors.torch import save_file

    torch.manual_seed(1)
    state = {k: v.detach().clone().contiguous() for k, v in GPT(CFG).state_dict().items()}
    del state["lm_head.weight"]  # tied to transformer.wte.weight: stored once, as Hugging Face stores it
    paths = {
        "torch": directory / "plain.pt",
        "prefixed": directory / "prefixed.pt",
        "safetensors": directory / "model.safetensors",
        "folder": directory / "hf",
    }
    torch.save(state, paths["torch"])
    torch.save({f"module._orig_mod.{k}": v for k, v in state.items()}, paths["prefixed"])
    save_file(state, str(paths["safetensors"]), metadata={"format": "pt"})
    paths["folder"].mkdir(exist_ok=True)
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(paths["folder"] / fname), metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": sum(v.numel() * v.element_size() for v in state.values())},
        "weight_map": {k: f for f, keys in halves.items() for k in keys},
    }
    (paths["folder"] / "model.safetensors.index.json").write_text(json.dumps(index))
    return paths


def case_load(backend: parallelx.Backend, out: Path) -> dict[str, Any]:
    directory = out / "weights"
    if backend.rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        write_files(directory)
    backend.barrier()
    paths = {
        "torch": directory / "plain.pt",
        "prefixed": directory / "prefixed.pt",
        "safetensors": directory / "model.safetensors",
        "folder": directory / "hf",
    }
    plain = torch.load(paths["torch"], weights_only=True)
    report: dict[str, Any] = {}
    for kind, path in paths.items():
        torch.manual_seed(0)
        eager = GPT(CFG)
        eager.load_state_dict(plain, strict=False)  # lm_head.weight comes with its tie
        torch.manual_seed(0)
        with parallelx.init_module():
            meta = GPT(CFG)
        weights = parallelx.load_pretrained(meta, path)
        read_before_setup = weights.bytes_read
        we, _ = backend.setup(eager, torch.optim.AdamW(eager.parameters(), lr=1e-2))
        wm, _ = backend.setup(meta, torch.optim.AdamW(meta.parameters(), lr=1e-2))
        se, sm = backend.model_state_dict(we), backend.model_state_dict(wm)
        report[kind] = {
            "mismatched": mismatched(se, sm),
            "loaded": torch.equal(sm["transformer.h.0.mlp.0.weight"], plain["transformer.h.0.mlp.0.weight"]),
            "read_before_setup": read_before_setup,
            "bytes_read": weights.bytes_read,
            "file_bytes": weights.total_bytes(),
        }
    # Wrong names and shapes: one error naming them all, before anything is read.
    bad = dict(plain)
    bad["transformer.wpe.weight"] = torch.zeros(3, 3)
    del bad["transformer.ln_f.weight"]
    bad["extra.weight"] = torch.zeros(1)
    bad_path = out / f"bad-rank{backend.rank}.pt"
    torch.save(bad, bad_path)
    with parallelx.init_module():
        meta = GPT(CFG)
    try:
        parallelx.load_pretrained(meta, bad_path)
        report["bad"] = {"accepted": True}
    except ParallelxError as exc:
        report["bad"] = {"error": str(exc)}
    del bad["transformer.wpe.weight"]
    torch.save(bad, bad_path)
    with parallelx.init_module():
        meta = GPT(CFG)
    weights = parallelx.load_pretrained(meta, bad_path, strict=False)
    wm, _ = backend.setup(meta, torch.optim.AdamW(meta.parameters(), lr=1e-2))
    sm = backend.model_state_dict(wm)
    report["lenient"] = {
        "wpe_from_init": not torch.equal(sm["transformer.wpe.weight"], plain["transformer.wpe.weight"]),
        "wte_loaded": torch.equal(sm["transformer.wte.weight"], plain["transformer.wte.weight"]),
    }
    return report


def case_save(backend: parallelx.Backend, out: Path) -> dict[str, Any]:
    from safetensors import safe_open
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    wm, om = backend.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert om is not None
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(7))
    before = backend.model_state_dict(wm)
    wm.train()
    backend.backward(wm(input_ids=x.to(backend.device), labels=x.to(backend.device)).loss)
    backend.step(om)
    wm.eval()
    with torch.no_grad():
        logits = wm(input_ids=x.to(backend.device)).logits.float().cpu()
    trained = backend.model_state_dict(wm)
    report: dict[str, Any] = {"step_changed": not all(torch.equal(before[k], trained[k]) for k in before)}
    for kind, size in (("single", None), ("sharded", "40KB")):
        folder = out / f"hf-{kind}"
        files = parallelx.save_pretrained(backend, wm, folder, max_shard_size=size)
        if backend.rank == 0:
            names = set()
            for f in files:
                with safe_open(str(f), framework="pt") as h:
                    names |= set(h.keys())
            loaded = GPT2LMHeadModel.from_pretrained(str(folder)).eval()
            with torch.no_grad():
                ref = loaded(input_ids=x).logits
            report[kind] = {
                "files": [f.name for f in files],
                "index": (folder / "model.safetensors.index.json").is_file(),
                "wte_stored": "transformer.wte.weight" in names,
                "lm_head_stored": "lm_head.weight" in names,
                "tied_after_load": loaded.lm_head.weight is loaded.transformer.wte.weight,
                "logits_max_abs_diff": float((ref - logits).abs().max()),
                "logits_scale": float(logits.abs().max()),
                "weights_mismatched": mismatched(
                    {k: v for k, v in trained.items() if k != "lm_head.weight"},
                    {k: v for k, v in loaded.state_dict().items() if k != "lm_head.weight"},
                ),
            }
    backend.barrier()
    return report


def case_setup(backend: parallelx.Backend) -> dict[str, Any]:
    """What set-up leaves for the first step: a GPT built under ``parallelx.init_module()``, set up with
    AdamW, a scheduler built at once and the learning rate read on rank 0 alone (a one-rank branch that
    must not wait for the others).  Under ZeRO-3 the engine (its gradient partition) waits for the
    first forward: ``built`` after each point; after the step, whether ZeRO-3's float32 partitions are
    its masters (no second copy) and whether the scheduler's groups are the ones the update uses."""
    torch.manual_seed(0)
    with parallelx.init_module():
        model = GPT(CFG)
    given = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = backend.setup(model, given)
    assert optimizer is not None

    def built() -> bool | None:
        return getattr(model, "built", None)  # DeepSpeed's wrapper says; the others have no engine

    report: dict[str, Any] = {"after_setup": built()}
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    if backend.is_main():
        report["lr"] = optimizer.param_groups[0]["lr"]
    report["after_scheduler_and_lr"] = built()
    backend.barrier()
    model.train()
    train_step(backend, model, optimizer)
    scheduler.step()
    report["after_step"] = built()
    report["lr_after"] = optimizer.param_groups[0]["lr"]
    report["same_groups"] = all(a is b for a, b in zip(optimizer.param_groups, given.param_groups, strict=True))
    zero = getattr(optimizer, "optimizer", None)
    if hasattr(zero, "fp32_partitioned_groups_flat"):
        pairs = zip(zero.fp32_partitioned_groups_flat, zero.fp16_partitioned_groups_flat, strict=True)
        report["masters_shared"] = [master.data_ptr() == weights.data_ptr() for master, weights in pairs]
    return report


CASES: dict[str, Case] = {
    "setup": lambda b, out: case_setup(b),
    "save": case_save,
    "meta": lambda b, out: case_meta(b),
    "plain": lambda b, out: case_plain(b),
    "load": case_load,
}


def main() -> int:
    return run_cases("bigmodels_worker", CASES)


if __name__ == "__main__":
    sys.exit(parallelx.exit_on_error(main)())
