"""The recipes' models: LeNet for CIFAR-10, torchvision's VGG16 for
Dogs-vs-Cats, a character-level GPT; and :func:`evaluate_state_dict`, one
process's evaluation of a classifier, the reference the recipes' distributed
validation figures must equal."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from parallelx import MetricSums
from parallelx.errors import ParallelxError

#: VGG16 halves the image five times: smaller inputs leave no pixels.
VGG16_MIN_IMAGE_SIZE = 32
#: Far beyond any photo worth training on at this scale, and already tens of
#: GiB of activations per batch.
VGG16_MAX_IMAGE_SIZE = 4096


class LeNet(nn.Module):
    """LeNet for 3x32x32 inputs: two 5x5 convolutions with max-pooling, then
    two fully connected layers."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 6, 5),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(16 * 5 * 5, 120), nn.ReLU(inplace=True), nn.Linear(120, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def check_vgg_image_size(image_size: int) -> None:
    if image_size < VGG16_MIN_IMAGE_SIZE:
        raise ParallelxError(
            f"--image-size {image_size} is too small for VGG16, which halves the image 5 times; "
            f"use at least {VGG16_MIN_IMAGE_SIZE} (224 is the size it was trained at)"
        )
    if image_size > VGG16_MAX_IMAGE_SIZE:
        raise ParallelxError(
            f"--image-size {image_size} is too large: a batch of 4 needs about "
            f"{_activation_gib(image_size, 4):.0f} GiB for VGG16's activations; use at most "
            f"{VGG16_MAX_IMAGE_SIZE} (224 is the size it was trained at)"
        )


def _activation_gib(image_size: int, batch: int) -> float:
    # The first two 64-channel convolutions alone keep 2 float32 maps of
    # size x size per image for the backward pass; the rest roughly doubles it.
    return 4 * 64 * image_size**2 * 4 * batch / 2**30


@functools.cache
def _vgg16_shapes() -> dict[str, tuple[int, ...]]:
    """Parameter shapes of torchvision's (1000-class) VGG16, from a model on
    the meta device: no memory, no initialisation cost."""
    from torchvision.models import vgg16

    with torch.device("meta"):
        reference = vgg16(weights=None)
    return {k: tuple(v.shape) for k, v in reference.state_dict().items()}


def _few(names: Iterable[str], n: int = 3) -> str:
    names = sorted(names)
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def check_vgg16_state(state: object, source: str) -> dict[str, torch.Tensor]:
    """``state`` as a VGG16 state dict, or a :class:`ParallelxError` that says
    what it is instead.  Accepted: a torchvision VGG16 ``state_dict()`` with
    any number of classes (the head of another class count is replaced), one
    saved from a wrapped model (``module.`` prefixes), or a parallelx
    checkpoint dict whose ``model`` entry is one."""
    how = "expected a VGG16 state dict saved with torch.save(model.state_dict(), PATH)"
    if isinstance(state, Mapping) and isinstance(state.get("model"), Mapping):
        state = state["model"]  # a full parallelx checkpoint
    if not isinstance(state, Mapping):
        raise ParallelxError(f"{source} holds a {type(state).__name__}, not a state dict; {how}")
    not_tensors = [str(k) for k, v in state.items() if not (isinstance(k, str) and isinstance(v, torch.Tensor))]
    if not_tensors:
        raise ParallelxError(f"{source} is not a state dict: entries {_few(not_tensors)} are not named tensors; {how}")
    state = dict(state)
    if state and all(k.startswith("module.") for k in state):  # saved from a DataParallel/DDP wrapper
        state = {k[len("module.") :]: v for k, v in state.items()}
    head = state.get("classifier.6.weight")
    if head is None:
        raise ParallelxError(
            f"{source} is not a VGG16 state dict (no classifier.6.weight; its keys look like "
            f"{_few(state) or 'nothing: it is empty'}); {how}"
        )
    reference = _vgg16_shapes()
    missing, unexpected = reference.keys() - state.keys(), state.keys() - reference.keys()
    if missing or unexpected:
        parts = ([f"missing {_few(missing)}"] if missing else []) + (
            [f"unexpected {_few(unexpected)}"] if unexpected else []
        )
        raise ParallelxError(f"{source} is not a VGG16 state dict ({'; '.join(parts)}): another model's weights? {how}")
    classes = head.shape[0] if head.dim() == 2 else -1
    for key, shape in reference.items():
        want = (classes, *shape[1:]) if key.startswith("classifier.6.") else shape
        if tuple(state[key].shape) != want:
            raise ParallelxError(
                f"{source} does not fit VGG16: {key} has shape {tuple(state[key].shape)}, "
                f"expected {want}; another model's weights?"
            )
    broken = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if broken:
        raise ParallelxError(
            f"{source} holds nan or inf values (in {_few(broken)}): training from them gives "
            "nan losses; use the file of a run that did not diverge"
        )
    return state


def read_vgg16_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """A ``--weights`` file, read onto the CPU and checked to be VGG16's (see
    :func:`check_vgg16_state`): before any process group is joined, so a
    wrong file stops the run at once."""
    p = Path(path)
    if not p.exists():
        raise ParallelxError(f"--weights {p}: no such file")
    if p.is_dir():
        raise ParallelxError(f"--weights {p} is a directory; expected a file written by torch.save")
    if p.stat().st_size == 0:
        raise ParallelxError(f"--weights {p} is empty; expected a VGG16 state dict written by torch.save")
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # garbage, truncated, pickled objects refused by weights_only
        raise ParallelxError(
            f"--weights {p} is not a readable PyTorch file ({_first_sentence(exc)}); expected a "
            "state dict written by torch.save: the file may be truncated, of another format, or "
            "hold pickled Python objects, which safe loading refuses"
        ) from None
    return check_vgg16_state(state, f"--weights {p}")


def _first_sentence(exc: BaseException) -> str:
    """``Type: first sentence``: torch.load's messages run to a paragraph (with terminal colour codes)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()
    first = re.split(r"(?<=\.)\s", text, maxsplit=1)[0][:160] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def imagenet_vgg16_state() -> dict[str, torch.Tensor]:
    """torchvision's ImageNet VGG16 weights, downloaded (or read from the
    torch hub cache)."""
    from torchvision.models import VGG16_Weights

    url = VGG16_Weights.IMAGENET1K_V1.url
    try:
        return torch.hub.load_state_dict_from_url(url, progress=True, check_hash=True)
    except Exception as exc:  # offline, proxy, disk: all end the same way
        raise ParallelxError(
            f"could not download the ImageNet VGG16 weights from {url} "
            f"({exc.__class__.__name__}: {exc}); download that file where the network allows "
            "and pass --weights PATH"
        ) from None


def vgg16_for_dogcat(
    *,
    pretrained: bool = False,
    weights: str | Path | Mapping[str, torch.Tensor] | None = None,
    freeze_features: bool = False,
    num_classes: int = 2,
) -> nn.Module:
    """torchvision's VGG16 with its last classifier layer replaced by a
    ``num_classes`` one.

    ``pretrained`` downloads torchvision's ImageNet weights (where the network
    allows); ``weights`` starts from a local file instead (or a state dict
    already read with :func:`read_vgg16_weights`): an ImageNet VGG16 state
    dict (its 1000-class head is replaced) or one of our own ``best.pth``
    files (already ``num_classes``).
    """
    from torchvision.models import vgg16

    if pretrained and weights is not None:
        raise ParallelxError("use either --pretrained or --weights PATH, not both")
    state: dict[str, torch.Tensor] | None = None
    if pretrained:
        state = imagenet_vgg16_state()
    elif isinstance(weights, Mapping):
        state = check_vgg16_state(weights, "the weights given")
    elif weights is not None:
        state = read_vgg16_weights(weights)
    model = vgg16(weights=None)
    head = nn.Linear(model.classifier[6].in_features, num_classes)
    if state is not None and state["classifier.6.weight"].shape[0] != num_classes:
        # Another class count (ImageNet's 1000): everything but the head.
        body = {k: v for k, v in state.items() if not k.startswith("classifier.6.")}
        model.load_state_dict({**body, **{f"classifier.6.{k}": v for k, v in model.classifier[6].state_dict().items()}})
        state = None
    model.classifier[6] = head
    if state is not None:
        model.load_state_dict(state)
    if freeze_features:
        for p in model.features.parameters():
            p.requires_grad_(False)
    return model


# ----------------------------------------------------------------- GPT
@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int = 64  # the longest context
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 96
    dropout: float = 0.1
    bias: bool = True  # in the Linear layers and LayerNorms

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ParallelxError(
                f"--n-embd {self.n_embd} must be a multiple of --n-head {self.n_head} (each head takes "
                f"n_embd / n_head channels); try --n-embd {self.n_head * max(1, round(self.n_embd / self.n_head))}"
            )


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # query, key, value at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.dropout = config.n_head, config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One transformer block, pre-LayerNorm: attention, then the MLP, each around a residual."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A GPT as nanoGPT builds it: token and position embeddings, ``n_layer``
    pre-LN blocks of causal self-attention and MLP, a final LayerNorm, and an
    output layer whose weight is the token embedding's (tied).  The blocks
    live in ``transformer.h``, an ``nn.ModuleList`` inside the
    ``transformer`` ``nn.ModuleDict``.  ``forward(idx)`` gives the logits of
    every position, ``(B, T, vocab_size)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(config.vocab_size, config.n_embd),
                "wpe": nn.Embedding(config.block_size, config.n_embd),
                "drop": nn.Dropout(config.dropout),
                "h": nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                "ln_f": nn.LayerNorm(config.n_embd, bias=config.bias),
            }
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied: one tensor, trained by both uses
        self.init_weights()

    def init_weights(self) -> None:
        """nanoGPT's initialisation, after the layers' own: normal(0, 0.02) weights, zero biases, and
        GPT-2's scaled init of the residual projections.  A model built under plain
        ``torch.device("meta")`` gets it with ``parallelx.init_weights(model, GPT.init_weights)``."""
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        length = idx.shape[1]
        if length > self.config.block_size:
            raise ParallelxError(
                f"a sequence of {length} tokens is longer than the block size {self.config.block_size}"
            )
        t = self.transformer
        pos = torch.arange(length, dtype=torch.long, device=idx.device)
        x = t.drop(t.wte(idx) + t.wpe(pos))
        for block in t.h:
            x = block(x)
        return self.lm_head(t.ln_f(x))


def gpt_param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, object]]:
    """AdamW's parameter groups as nanoGPT makes them: every 2-D tensor (the
    matmul weights and the embeddings, the tied one counted once) decays,
    the biases and LayerNorm weights do not."""
    params = [p for p in model.parameters() if p.requires_grad]  # each tensor once, the tied one included
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


# ---------------------------------------------------------- the reference
def evaluate_state_dict(model: nn.Module, dataset: Dataset, batch_size: int = 256) -> dict[str, float]:
    """Single-process evaluation of the classifier ``model`` on ``dataset``
    (no backend): the reference the recipes' distributed val figures must equal."""
    model.eval()
    sums = MetricSums()
    criterion = nn.CrossEntropyLoss(reduction="none")
    with torch.no_grad():
        for x, y in DataLoader(dataset, batch_size=batch_size):
            out = model(x)
            sums.update(criterion(out, y), out.argmax(1) == y)
    return sums.compute()
