"""CIFAR-10 with LeNet, on any backend.

    python -m recipes.cifar10 --backend single --data-dir data/cifar10
    python -m recipes.cifar10 --backend dp --data-dir data/cifar10
    torchrun --nproc-per-node 2 -m recipes.cifar10 --backend ddp --data-dir data/cifar10
    horovodrun -np 2 python -m recipes.cifar10 --backend horovod --data-dir data/cifar10
    deepspeed --num_gpus 2 recipes/cifar10.py --backend deepspeed --zero-stage 2 --data-dir data/cifar10

``--data-dir`` is a ``cifar-10-batches-py`` folder or its parent; ``--download``
fetches the official files there.  No network?  ``python -m recipes.make_data
cifar10 --out data/cifar10`` writes a stand-in in the same format.

Batch arithmetic: ``--batch-size`` is per process, so the global batch is
``batch_size x world_size``; scale ``--lr`` with it if you change the world size.
On 2 CPU cores, 2 epochs of 5,000 generated images take about a minute.
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
from recipes.data import load_cifar10
from recipes.engine import FitConfig, fit
from recipes.models import LeNet


@exit_on_error
def main(argv: list[str] | None = None) -> int:
    parser = base_parser("recipes.cifar10", "CIFAR-10 with LeNet", epochs=10, batch_size=64, lr=0.01)
    parser.add_argument("--download", action="store_true", help="download CIFAR-10 into --data-dir")
    parser.add_argument("--skip-checksum", action="store_true", help="read files whose md5 sums are not official")
    args = parser.parse_args(argv)

    backend = backend_from_args(args)
    backend.init()
    seed_everything(args.seed)  # same initial weights on every rank

    train_set, val_set = load_cifar10(args.data_dir, download=args.download, skip_checksum=args.skip_checksum,
                                      verbose=backend.is_main())
    model = LeNet(num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    model, optimizer = backend.setup(model, optimizer)

    cfg = FitConfig(epochs=args.epochs, batch_size=args.batch_size, seed=args.seed, num_workers=args.num_workers,
                    max_steps=args.max_steps, out_dir=args.out_dir or Path("runs") / f"cifar10-{backend.name}")
    fit(backend, model, optimizer, train_set, val_set, cfg, run_info={"recipe": "cifar10", "model": "LeNet"})
    backend.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
