"""Dogs-vs-Cats: fine-tune torchvision's VGG16 with a 2-class head, on any backend.

    python -m recipes.dogcat --backend single --data-dir data/dogcat --image-size 64
    python -m recipes.dogcat --backend dp --data-dir data/dogcat
    torchrun --nproc-per-node 2 -m recipes.dogcat --backend ddp --data-dir data/dogcat
    horovodrun -np 2 python -m recipes.dogcat --backend horovod --data-dir data/dogcat
    deepspeed --num_gpus 2 recipes/dogcat.py --backend deepspeed --data-dir data/dogcat

``--data-dir`` holds Kaggle's ``train/`` folder (``cat.0.jpg``, ``dog.0.jpg``, ...),
optionally with ``train.csv`` (``filename,label``).  80 % trains, 20 % validates
(fixed split).  ``--pretrained`` starts from torchvision's ImageNet weights
(downloaded where the network allows), ``--weights PATH`` from a local file,
``--freeze-features`` trains only the classifier.  Unreadable image files are
skipped with a warning that counts them.

VGG16 has 138 M parameters: on 2 CPU cores expect ~10 images/s at
``--image-size 64``; on GPUs use 224 and a batch of 32 per GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file, as the deepspeed launcher does
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from parallelx import seed_everything
from parallelx.cli import backend_from_args, exit_on_error
from recipes.common import base_parser
from recipes.data import load_dogcat
from recipes.engine import FitConfig, fit
from recipes.models import check_vgg_image_size, vgg16_for_dogcat


@exit_on_error
def main(argv: list[str] | None = None) -> int:
    parser = base_parser("recipes.dogcat", "Dogs-vs-Cats with VGG16", epochs=3, batch_size=16, lr=0.001)
    parser.add_argument("--image-size", type=int, default=224, help="images are resized to SIZE x SIZE")
    parser.add_argument("--pretrained", action="store_true", help="start from torchvision's ImageNet weights")
    parser.add_argument("--weights", type=Path, default=None, help="start from a local VGG16 state dict")
    parser.add_argument("--freeze-features", action="store_true", help="train the classifier only")
    parser.add_argument("--val-fraction", type=float, default=0.2)
    args = parser.parse_args(argv)
    check_vgg_image_size(args.image_size)  # before any process group is joined

    backend = backend_from_args(args)
    backend.init()
    seed_everything(args.seed)  # same initial weights on every rank

    train_set, val_set = load_dogcat(args.data_dir, args.image_size, val_fraction=args.val_fraction, seed=args.seed,
                                     verbose=backend.is_main())
    model = vgg16_for_dogcat(pretrained=args.pretrained, weights=args.weights, freeze_features=args.freeze_features)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=args.lr, momentum=args.momentum)
    model, optimizer = backend.setup(model, optimizer)

    cfg = FitConfig(epochs=args.epochs, batch_size=args.batch_size, seed=args.seed, num_workers=args.num_workers,
                    max_steps=args.max_steps, out_dir=args.out_dir or Path("runs") / f"dogcat-{backend.name}")
    fit(backend, model, optimizer, train_set, val_set, cfg,
        run_info={"recipe": "dogcat", "model": "vgg16", "image_size": args.image_size})
    backend.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
