"""A small GPT for the tests, built the way nanoGPT builds one: token and
position embeddings, pre-LayerNorm blocks of causal self-attention and an
MLP, the blocks in a ``ModuleList`` inside a ``ModuleDict``, and the output
layer's weight tied to the token embedding.  Plus what real scripts have that
the loop must handle: AdamW with decay and no-decay groups of different
hyperparameters, a frozen parameter, and a trainable one outside every group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class Config:
    vocab: int = 48
    block: int = 16
    layers: int = 2
    heads: int = 2
    width: int = 32
    dropout: float = 0.0
    bias: bool = True


class Attention(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.c_attn = nn.Linear(cfg.width, 3 * cfg.width, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.width, cfg.width, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.resid(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.width, bias=cfg.bias)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.width, bias=cfg.bias)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.width, 4 * cfg.width, bias=cfg.bias),
            nn.GELU(),
            nn.Linear(4 * cfg.width, cfg.width, bias=cfg.bias),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: Config = Config()) -> None:
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab, cfg.width),
                wpe=nn.Embedding(cfg.block, cfg.width),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList([Block(cfg) for _ in range(cfg.layers)]),
                ln_f=nn.LayerNorm(cfg.width, bias=cfg.bias),
            )
        )
        self.lm_head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as GPT-2
        # A learned scale on the logits that the script trains outside its optimizer's groups
        # (a second optimizer, or a hand-written update), and a frozen one.
        self.logit_scale = nn.Parameter(torch.ones(1))
        self.frozen_shift = nn.Parameter(torch.zeros(cfg.vocab), requires_grad=False)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = idx.shape[1]
        tr = self.transformer
        x = tr.drop(tr.wte(idx) + tr.wpe(torch.arange(t, device=idx.device)))
        for block in tr.h:
            x = block(x)
        logits = self.lm_head(tr.ln_f(x)) * self.logit_scale + self.frozen_shift
        loss = (
            None if targets is None else F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        )
        return logits, loss


def adamw_groups(model: nn.Module, lr: float = 3e-3) -> torch.optim.AdamW:
    """nanoGPT's split (2-D weights decay, the rest not), and the embeddings in a group of their own with
    another learning rate; ``logit_scale`` is left out of every group, the frozen parameter too."""
    named = {n: p for n, p in model.named_parameters() if p.requires_grad and n != "logit_scale"}
    emb = {n for n in named if "wpe" in n or "wte" in n or "lm_head" in n}
    decay = [p for n, p in named.items() if p.dim() >= 2 and n not in emb]
    no_decay = [p for n, p in named.items() if p.dim() < 2 and n not in emb]
    embeddings = [p for n, p in named.items() if n in emb]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0},
            {"params": embeddings, "weight_decay": 0.01, "lr": lr * 0.5},
        ],
        lr=lr,
        betas=(0.9, 0.95),
    )


def tokens(rank: int, step: int, batch: int, cfg: Config = Config()) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch ``step``: inputs and next-token targets from a seeded stream."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    seq = torch.randint(cfg.vocab, (batch, cfg.block + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]
