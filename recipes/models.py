"""The recipes' models: LeNet for CIFAR-10, torchvision's VGG16 for Dogs-vs-Cats."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

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
