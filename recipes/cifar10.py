"""CIFAR-10 with LeNet, on any backend.

    python -m recipes.cifar10 --backend single --data-dir data/cifar10
    python -m recipes.cifar10 --backend dp --data-dir data/cifar10
    torchrun --nproc-per-node 2 -m recipes.cifar10 --backend ddp --data-dir data/cifar10
    torchrun --nproc-per-node 2 -m recipes.cifar10 --backend fsdp --data-dir data/cifar10
    horovodrun -np 2 python -m recipes.cifar10 --backend horovod --data-dir data/cifar10
    deepspeed --num_gpus 2 recipes/cifar10.py --backend deepspeed --zero-stage 2 --data-dir data/cifar10
    torchrun --nproc-per-node 2 --max-restarts 3 -m recipes.cifar10 --backend ddp --data-dir data/cifar10 \\
        --checkpoint-every 100 --resume auto       # restarted after a failure, it continues from a checkpoint

``--data-dir`` is a ``cifar-10-batches-py`` folder or its parent; ``--download``
fetches the official files there.  No network?  ``python -m recipes.make_data
cifar10 --out data/cifar10`` writes a stand-in in the same format.

Batch arithmetic: ``--batch-size`` is per process, so the global batch is
``batch_size x world_size`` (x ``--accumulate``); scale ``--lr`` with it if you
change the world size.  On 2 CPU cores, 2 epochs of 5,000 generated images take
about a minute.

:func:`train`, below, makes the model and the optimizer; the training loop
(the epochs, the batches, the backward pass and the optimizer step,
validation, the checkpoints) is ``classify.py``'s, shared with the
Dogs-vs-Cats recipe.  The helpers hold the command line (``common.py``), the
data (``data.py``) and the files written at the end (``history.py``).
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
from parallelx import Backend

from . import classify
from .common import base_parser, validate
from .data import cifar10_folder, load_cifar10
from .models import LeNet

RECIPE = "cifar10"


def build_parser() -> argparse.ArgumentParser:
    parser = base_parser(f"python -m {__package__}.cifar10", "CIFAR-10 with LeNet", epochs=10, batch_size=64, lr=0.01)
    parser.add_argument("--download", action="store_true", help="download CIFAR-10 into --data-dir")
    parser.add_argument("--skip-checksum", action="store_true", help="read files whose md5 sums are not official")
    return parser


@parallelx.exit_on_error
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Everything that can be checked without reading the data or joining a
    # process group is checked first: the backend's own options (a DeepSpeed
    # config file) when it is built, then the paths.
    backend = parallelx.from_args(args)
    args.out_dir = args.out_dir or Path("runs") / f"cifar10-{backend.name}"
    validate(args)
    cifar10_folder(args.data_dir, download=args.download)

    with backend:  # released on every rank when anything below raises
        parallelx.seed_everything(args.seed)  # same initial weights on every rank
        with parallelx.main_process_first(backend):  # --download: rank 0 fetches the files, the others then read them
            train_set, val_set = load_cifar10(args.data_dir, download=args.download, skip_checksum=args.skip_checksum)
        attempts = itertools.count()

        def attempt() -> None:
            # Called again in the new world after a lost rank (horovodrun --min-np):
            # then from the seed, and from the latest checkpoint if there is one.
            if next(attempts):
                parallelx.seed_everything(args.seed)
                args.resume = "auto"
            train(backend, args, train_set, val_set)

        backend.run_elastic(attempt)
    return 0


def train(backend: Backend, args: argparse.Namespace, train_set: Dataset, val_set: Dataset) -> None:
    """LeNet, trained from scratch with SGD by the image recipes' loop (``classify.train``): it writes
    ``best.pth``, ``last.pth``, ``history.csv``, ``metrics.json`` and ``training_results.png`` into
    ``--out-dir``, and with ``--checkpoint-every`` or ``--resume``, training-state checkpoints under
    ``OUT_DIR/checkpoints/``.  Every rank runs all of it."""
    model = LeNet(num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    classify.train(
        backend,
        args,
        model,
        optimizer,
        train_set,
        val_set,
        recipe=RECIPE,
        run_info={"recipe": RECIPE, "model": "LeNet"},
    )


if __name__ == "__main__":
    sys.exit(main())
