"""Dogs-vs-Cats: fine-tune torchvision's VGG16 with a 2-class head, on any backend.

    python -m recipes.dogcat --backend single --data-dir data/dogcat --image-size 64
    python -m recipes.dogcat --backend dp --data-dir data/dogcat
    torchrun --nproc-per-node 2 -m recipes.dogcat --backend ddp --data-dir data/dogcat
    horovodrun -np 2 python -m recipes.dogcat --backend horovod --data-dir data/dogcat
    deepspeed --num_gpus 2 recipes/dogcat.py --backend deepspeed --data-dir data/dogcat
    torchrun --nproc-per-node 2 -m recipes.dogcat --backend fsdp --data-dir data/dogcat

``--data-dir`` holds Kaggle's ``train/`` folder (``cat.0.jpg``, ``dog.0.jpg``, ...),
optionally with ``train.csv`` (``filename,label``).  80 % trains, 20 % validates
(fixed split).  ``--pretrained`` starts from torchvision's ImageNet weights
(downloaded where the network allows), ``--weights PATH`` from a local file,
``--freeze-features`` trains only the classifier.  Unreadable image files are
skipped with a warning that counts them.

VGG16 has 138 M parameters: on 2 CPU cores expect ~10 images/s at
``--image-size 64``; on GPUs use 224 and a batch of 32 per GPU.  Batch
arithmetic: ``--batch-size`` is per process, so the global batch is
``batch_size x world_size`` (x ``--accumulate``).

:func:`train`, below, makes the model and the optimizer; the training loop
(the epochs, the batches, the backward pass and the optimizer step,
validation, the checkpoints) is ``classify.py``'s, shared with the CIFAR-10
recipe.  The helpers hold the command line (``common.py``), the data
(``data.py``), the model (``models.py``) and the files written at the end
(``history.py``).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

if not __package__:  # run as a file (the deepspeed launcher does): be the package module all the same
    _folder = Path(__file__).resolve().parent
    # Python put this folder first on sys.path, where data.py, models.py, ...
    # would shadow any top-level module of those names; the repository root goes there instead.
    sys.path[:] = [str(_folder.parent), *(p for p in sys.path if Path(p or ".").resolve() != _folder)]
    import recipes  # noqa: F401  (the package the relative imports below resolve in)

    __package__ = "recipes"

import torch
from torch.utils.data import Dataset

import parallelx
from parallelx import Backend, ParallelxError
from parallelx.utils import threads_per_process

from . import classify
from .common import base_parser, fraction, validate
from .data import list_dogcat, load_dogcat, split_indices
from .models import (
    VGG16_MAX_IMAGE_SIZE,
    VGG16_MIN_IMAGE_SIZE,
    check_vgg_image_size,
    imagenet_vgg16_state,
    read_vgg16_weights,
    vgg16_for_dogcat,
)

RECIPE = "dogcat"


def image_size(text: str) -> int:
    """argparse type: an image size VGG16 can take."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer number of pixels, got {text!r}") from None
    try:
        check_vgg_image_size(value)
    except ParallelxError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--image-size ")) from None
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = base_parser(
        f"python -m {__package__}.dogcat", "Dogs-vs-Cats with VGG16", epochs=3, batch_size=16, lr=0.001
    )
    parser.add_argument(
        "--image-size",
        type=image_size,
        default=224,
        metavar="SIZE",
        help=f"images are resized to SIZE x SIZE, {VGG16_MIN_IMAGE_SIZE} to {VGG16_MAX_IMAGE_SIZE}",
    )
    parser.add_argument("--pretrained", action="store_true", help="start from torchvision's ImageNet weights")
    parser.add_argument(
        "--weights",
        type=Path,
        default=None,
        help="start from a local VGG16 state dict (default: torchvision's random initialisation, unless --pretrained)",
    )
    parser.add_argument("--freeze-features", action="store_true", help="train the classifier only")
    parser.add_argument("--val-fraction", type=fraction, default=0.2, help="share of the images that validates")
    return parser


def starting_weights(args: argparse.Namespace) -> dict[str, torch.Tensor] | None:
    """The VGG16 weights to start from: ImageNet's (``--pretrained``), a file's
    (``--weights``), or None for torchvision's random initialisation."""
    if args.pretrained:
        return imagenet_vgg16_state()
    if args.weights is not None:
        return read_vgg16_weights(args.weights)
    return None


@parallelx.exit_on_error
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.pretrained and args.weights is not None:
        raise ParallelxError("use either --pretrained or --weights PATH, not both")
    # Everything that can be checked without decoding images or joining a
    # process group is checked first: the backend's own options (a DeepSpeed
    # config file) when it is built, the paths, the listing of the data and
    # whether it splits, the starting weights.
    backend = parallelx.from_args(args)
    args.out_dir = args.out_dir or Path("runs") / f"dogcat-{backend.name}"
    validate(args)
    split_indices(len(list_dogcat(args.data_dir)[0]), args.val_fraction, args.seed)
    start = starting_weights(args)

    with backend:  # released on every rank when anything below raises
        parallelx.seed_everything(args.seed)  # same initial weights on every rank
        train_set, val_set = load_dogcat(
            args.data_dir,
            args.image_size,
            val_fraction=args.val_fraction,
            seed=args.seed,
            threads=threads_per_process(backend.local_world_size),
        )
        attempts = itertools.count()

        def attempt() -> None:
            # Called again in the new world after a lost rank (horovodrun --min-np):
            # then from the seed, the starting weights read again, and the latest checkpoint.
            nonlocal start
            weights = start
            start = None  # the model holds its own copy
            if next(attempts):
                parallelx.seed_everything(args.seed)
                args.resume = "auto"
                weights = starting_weights(args)
            train(backend, args, train_set, val_set, weights)

        backend.run_elastic(attempt)
    return 0


def train(
    backend: Backend,
    args: argparse.Namespace,
    train_set: Dataset,
    val_set: Dataset,
    weights: dict[str, torch.Tensor] | None,
) -> None:
    """Fine-tune VGG16 from ``weights`` (None: torchvision's random initialisation)
    for ``--epochs`` with the image recipes' loop (``classify.train``); write ``best.pth``, ``last.pth``, ``history.csv``,
    ``metrics.json`` and ``training_results.png`` into ``--out-dir``, and with
    ``--checkpoint-every`` or ``--resume``, training-state checkpoints under
    ``OUT_DIR/checkpoints/``.  Every rank runs all of it."""
    model = vgg16_for_dogcat(weights=weights, freeze_features=args.freeze_features)
    trainable = [p for p in model.parameters() if p.requires_grad]  # the classifier only, with --freeze-features
    optimizer = torch.optim.SGD(trainable, lr=args.lr, momentum=args.momentum)
    run_info = {"recipe": RECIPE, "model": "vgg16", "image_size": args.image_size}
    classify.train(backend, args, model, optimizer, train_set, val_set, recipe=RECIPE, run_info=run_info)


if __name__ == "__main__":
    sys.exit(main())
