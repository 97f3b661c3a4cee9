"""Karpathy's nanoGPT ``train.py``, ported to parallelx: its config globals and
``--key=value`` overrides, a GPT with tied input/output embeddings, AdamW with
decay / no-decay groups, a hand-set cosine learning rate written into
``param_groups``, gradient accumulation, clipping, random batches drawn per
rank (``torch.manual_seed(1337 + seed_offset)``), and evaluation on the master
process.  The data is a token stream made in memory (no download here).

    torchrun --nproc-per-node 2 tests/support/check_scripts/nanogpt_port.py --backend ddp
    deepspeed --num_gpus 2 tests/support/check_scripts/nanogpt_port.py --backend deepspeed --zero-stage 3
    python tests/support/check_scripts/nanogpt_port.py --backend single --max_iters=20

What changed from the original: DDP's set-up became ``parallelx.from_args``
(``ddp_rank``, ``ddp_world_size`` and ``master_process`` come from the
backend), ``DDP(model)`` and the optimizer became ``backend.setup``, the
``require_backward_grad_sync`` micro-step loop became
``backend.batches(stream, limit=gradient_accumulation_steps)`` with
``backend.backward`` and ``backend.step`` (which clips at ``grad_clip``), and
the master's evaluation runs on a plain copy of the whole weights, which every
rank gathers first (a sharded model's forward is a collective).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import parallelx

# -----------------------------------------------------------------------------
# default config values (a tiny GPT on a synthetic token stream)
out_dir = "out"
eval_interval = 4
log_interval = 1
eval_iters = 2
eval_only = False
gradient_accumulation_steps = 4  # the global count; each rank takes its share
batch_size = 4
block_size = 16
n_layer = 2
n_head = 2
n_embd = 32
dropout = 0.1
bias = False
vocab_size = 64
learning_rate = 3e-3
max_iters = 40
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
decay_lr = True
warmup_iters = 2
lr_decay_iters = 40
min_lr = 3e-4
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, bool, str))]


def configure(rest: list[str]) -> None:
    """nanoGPT's configurator: ``--key=value`` overrides the globals above."""
    for arg in rest:
        if not arg.startswith("--") or "=" not in arg:
            raise SystemExit(f"unknown argument {arg!r}: overrides are --key=value")
        key, value = arg[2:].split("=", 1)
        if key not in config_keys:
            raise SystemExit(f"unknown config key {key!r}")
        kind = type(globals()[key])
        globals()[key] = (value == "True") if kind is bool else kind(value)


# ----------------------------------------------------------------------------- model.py
@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = False


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.drop(self.c_proj(F.gelu(self.c_fc(self.ln_2(x)))))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay: float, learning_rate: float, betas: tuple[float, float]):
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        decay_params = [p for p in param_dict.values() if p.dim() >= 2]
        nodecay_params = [p for p in param_dict.values() if p.dim() < 2]
        optim_groups = [
            {"params": decay_params, "weight_decay": weight_decay},
            {"params": nodecay_params, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas)


# ----------------------------------------------------------------------------- train.py
def main() -> None:
    parser = argparse.ArgumentParser()
    parallelx.add_arguments(parser)
    args, rest = parser.parse_known_args()
    configure(rest)
    global gradient_accumulation_steps
    with parallelx.from_args(args) as backend:
        ddp_rank, ddp_world_size = backend.rank, backend.world_size
        master_process = backend.is_main()
        seed_offset = ddp_rank  # each process gets a different seed
        if gradient_accumulation_steps % ddp_world_size:
            raise SystemExit(
                f"gradient_accumulation_steps ({gradient_accumulation_steps}) must be a multiple of the "
                f"world size ({ddp_world_size})"
            )
        gradient_accumulation_steps //= ddp_world_size
        tokens_per_iter = gradient_accumulation_steps * ddp_world_size * batch_size * block_size
        if master_process:
            print(f"tokens per iteration will be: {tokens_per_iter:,}")
        torch.manual_seed(1337 + seed_offset)
        device = backend.device

        # the "dataset": a token stream with structure (a repeated motif with noise), train and val splits
        g = torch.Generator().manual_seed(0)
        motif = torch.randint(0, vocab_size, (13,), generator=g)
        stream = motif.repeat(400)
        noise = torch.rand(len(stream), generator=g) < 0.1
        stream[noise] = torch.randint(0, vocab_size, (int(noise.sum()),), generator=g)
        splits = {"train": stream[:4800], "val": stream[4800:]}

        def get_batch(split: str):
            data = splits[split]
            ix = torch.randint(len(data) - block_size, (batch_size,))
            x = torch.stack([data[i : i + block_size] for i in ix])
            y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix])
            return x.to(device), y.to(device)

        def train_batches():
            while True:
                yield get_batch("train")

        iter_num = 0
        best_val_loss = 1e9
        model_args = dict(
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            block_size=block_size,
            bias=bias,
            vocab_size=vocab_size,
            dropout=dropout,
        )
        model = GPT(GPTConfig(**model_args))
        optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2))
        backend.set_options(accumulate=gradient_accumulation_steps, clip_grad_norm=grad_clip or None)
        model, optimizer = backend.setup(model, optimizer)

        @torch.no_grad()
        def estimate_loss(plain: nn.Module) -> dict[str, float]:
            out = {}
            plain.eval()
            for split in ["train", "val"]:
                losses = torch.zeros(eval_iters)
                for k in range(eval_iters):
                    X, Y = get_batch(split)
                    with backend.autocast():
                        _, loss = plain(X, Y)
                    losses[k] = loss.item()
                out[split] = float(losses.mean())
            return out

        def get_lr(it: int) -> float:
            if it < warmup_iters:
                return learning_rate * (it + 1) / (warmup_iters + 1)
            if it > lr_decay_iters:
                return min_lr
            decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
            coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
            return min_lr + coeff * (learning_rate - min_lr)

        stream_of_batches = train_batches()
        t0 = time.time()
        while True:
            lr = get_lr(iter_num) if decay_lr else learning_rate
            for param_group in optimizer.param_groups:
                param_group["lr"] = lr

            if iter_num % eval_interval == 0:
                state = backend.model_state_dict(model)  # every rank: the sharded backends gather
                if master_process:
                    plain = GPT(GPTConfig(**model_args)).to(device)
                    plain.load_state_dict(state)
                    losses = estimate_loss(plain)
                    print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
                    best_val_loss = min(best_val_loss, losses["val"])
            if iter_num == 0 and eval_only:
                break

            for X, Y in backend.batches(stream_of_batches, limit=gradient_accumulation_steps):
                with backend.autocast():
                    logits, loss = model(X, Y)
                backend.backward(loss)
                result = backend.step(optimizer)  # at the window's end: average, clip, step, zero

            t1 = time.time()
            dt, t0 = t1 - t0, t1
            if iter_num % log_interval == 0 and master_process:
                norm = float(result.grad_norm) if result is not None else float("nan")
                print(f"iter {iter_num}: loss {loss.item():.4f}, norm {norm:.4f}, time {dt * 1000:.2f}ms")
            iter_num += 1
            if iter_num > max_iters:
                break


if __name__ == "__main__":
    main()
