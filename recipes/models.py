"""The recipes' models: LeNet for CIFAR-10, torchvision's VGG16 for Dogs-vs-Cats."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from parallelx.errors import ParallelxError

#: VGG16 halves the image five times: smaller inputs leave no pixels.
VGG16_MIN_IMAGE_SIZE = 32


class LeNet(nn.Module):
    """LeNet for 3x32x32 inputs: two 5x5 convolutions with max-pooling, then
    two fully connected layers."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 6, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(16 * 5 * 5, 120), nn.ReLU(inplace=True),
                                        nn.Linear(120, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def check_vgg_image_size(image_size: int) -> None:
    if image_size < VGG16_MIN_IMAGE_SIZE:
        raise ParallelxError(f"--image-size {image_size} is too small for VGG16, which halves the image 5 times; "
                             f"use at least {VGG16_MIN_IMAGE_SIZE} (224 is the size it was trained at)")


def vgg16_for_dogcat(*, pretrained: bool = False, weights: str | Path | None = None,
                     freeze_features: bool = False, num_classes: int = 2) -> nn.Module:
    """torchvision's VGG16 with its last classifier layer replaced by a
    ``num_classes`` one.

    ``pretrained`` downloads torchvision's ImageNet weights (where the network
    allows); ``weights`` loads a local file instead: either an ImageNet VGG16
    state dict (1000 classes, loaded before the head is replaced) or one of
    our own ``best.pth`` files (already ``num_classes``).
    """
    from torchvision.models import VGG16_Weights, vgg16

    if pretrained and weights is not None:
        raise ParallelxError("use either --pretrained or --weights PATH, not both")
    model = vgg16(weights=None)
    if pretrained:
        url = VGG16_Weights.IMAGENET1K_V1.url
        try:
            state = torch.hub.load_state_dict_from_url(url, progress=True, check_hash=True)
        except Exception as exc:  # offline, proxy, disk: all end the same way
            raise ParallelxError(f"could not download the ImageNet VGG16 weights from {url} "
                                 f"({exc.__class__.__name__}: {exc}); download that file where the network allows "
                                 "and pass --weights PATH") from None
        model.load_state_dict(state)
    state = None
    if weights is not None:
        path = Path(weights)
        if not path.is_file():
            raise ParallelxError(f"--weights {path}: no such file")
        state = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
            state = state["model"]  # a full parallelx checkpoint
        head = state.get("classifier.6.weight") if isinstance(state, dict) else None
        if head is None:
            raise ParallelxError(f"--weights {path} is not a VGG16 state dict (no classifier.6.weight)")
        if head.shape[0] != num_classes:
            model.load_state_dict(state)  # ImageNet weights: load, then replace the head
            state = None
    model.classifier[6] = nn.Linear(model.classifier[6].in_features, num_classes)
    if state is not None:
        model.load_state_dict(state)
    if freeze_features:
        for p in model.features.parameters():
            p.requires_grad_(False)
    return model
