"""Dogs-vs-Cats input-pipeline throughput: the images/s one DataLoader worker
delivers (decode, resize, flip, normalise), against what the model consumes.

    python -m benchmarks.loader_bench --make 100 --data-dir /tmp/dogcat --image-size 64 --out loader.json

``--make N`` first writes N generated JPEGs per class, smaller than Kaggle's
photos (64-320 against about 350 x 500 px): real ones decode somewhat slower.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from benchmarks.workload import BenchError
from parallelx.cli import exit_on_error


def measure(dataset: torch.utils.data.Dataset, *, workers: int, batch: int, batches: int) -> dict[str, float]:
    """Steady-state images/s over ``batches`` batches (the first pays for the worker's start-up: not counted)."""
    # Persistent workers: a new epoch must not pay for a worker start-up again.
    loader = DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers, drop_last=True,
                        persistent_workers=workers > 0, generator=torch.Generator().manual_seed(0))
    seen, start, first_s = 0, time.perf_counter(), None
    while seen < batches:
        for _ in loader:
            if first_s is None:
                first_s, start = time.perf_counter() - start, time.perf_counter()
                continue
            seen += 1
            if seen >= batches:
                break
    return {"workers": workers, "images_per_s": seen * batch / (time.perf_counter() - start),
            "first_batch_s": first_s or 0.0, "batches": seen, "batch": batch}


@exit_on_error
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", type=Path, required=True, help="a Kaggle-layout folder (train/cat.0.jpg ...)")
    p.add_argument("--make", type=int, default=0, metavar="N", help="first generate N images per class there")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--batches", type=int, default=20, help="timed batches per measurement")
    p.add_argument("--workers", default="0,1", help="comma-separated worker counts to measure")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the measuring process")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from recipes.data import DogCatDataset, scan_dogcat
    from recipes.make_data import make_dogcat

    if args.make:
        make_dogcat(args.data_dir, n_per_class=args.make, seed=0)
    files, labels = scan_dogcat(args.data_dir)
    if len(files) < args.batch * 2:
        raise BenchError(f"{args.data_dir} has {len(files)} images; need at least {args.batch * 2} "
                         "(use --make N to generate some)")
    dataset = DogCatDataset(files, labels, args.image_size, train=True)
    results = [measure(dataset, workers=int(w), batch=args.batch, batches=args.batches)
               for w in args.workers.split(",")]
    args.out.write_text(json.dumps({"data_dir": str(args.data_dir), "generated": bool(args.make),
                                    "images": len(files), "image_size": args.image_size, "threads": args.threads,
                                    "results": results}, indent=1))
    for r in results:
        print(f"loader: {r['workers']} worker(s): {r['images_per_s']:.0f} images/s at {args.image_size}px")
    return 0


if __name__ == "__main__":
    sys.exit(main())
