"""Training-state checkpoints in an S3-compatible store, under a real launcher
(tests/system/test_object_store.py starts the store and this worker at 2 processes).

A: train SAVE_AT steps, save to ``--url`` (every step, keep 2), train MORE.  B:
fresh objects (other initial weights), the latest complete checkpoint found in
the store as ``--resume auto`` finds it, MORE steps: A == B bitwise.  Also
``backend.save`` / ``backend.load`` of the weights through the same URL, and
``save_pretrained`` into it (``URL/hf``).  ``--background``: the saves in the background (each
rank stages its files, sharded or not, then uploads them while the training goes on).
``--full-disk``: after A's steps, one more save with the staging disk full, which must fail on every
rank (B then resumes from the latest complete checkpoint as before).
Rank 0 writes ``result.pt`` into the local ``--out``.
"""

from __future__ import annotations

import argparse
import errno
import tempfile
from pathlib import Path

import torch
from trainstate_worker import Run

import parallelx

SAVE_AT, MORE = 3, 2


def save_on_a_full_disk(run: Run, url: str) -> str:
    """Fill the disk the shards are staged on (the temporary directory: a small tmpfs the test mounted),
    save in the background, and return the error every rank raises; the disk freed after."""
    backend = run.backend
    filler = Path(tempfile.gettempdir()) / "filler"
    if backend.is_main():
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(bytes(1 << 20))
                    f.flush()
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
    backend.barrier()
    try:
        run.save(url, keep=2, asynchronous=True)
        parallelx.wait_for_checkpoint(backend)
    except parallelx.ParallelxError as exc:
        return str(exc)
    finally:
        backend.barrier()
        filler.unlink(missing_ok=True)
    return "no error"


def main() -> None:
    parser = argparse.ArgumentParser()
    parallelx.add_arguments(parser)
    parser.add_argument("--url", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--background", action="store_true", help="the saves in the background")
    parser.add_argument("--full-disk", action="store_true", help="one more save after A's, its staging disk full")
    args = parser.parse_args()
    backend = parallelx.from_args(args)
    with backend:
        a = Run(backend, "adamw", dropout=0.0, noise=False)
        saved = []
        for _ in range(SAVE_AT):
            a.train(1)
            saved.append(str(a.save(args.url, keep=2, asynchronous=args.background)))
        parallelx.wait_for_checkpoint(backend)
        at_3 = a.weights()  # a collective under fsdp: on every rank
        a.train(MORE)
        full_disk = save_on_a_full_disk(a, args.url) if args.full_disk else None
        # Every rank's pieces (fsdp: each rank's rows) meet in the store's files, 3 of them here.
        pretrained = parallelx.save_pretrained(backend, a.model, f"{args.url}/hf", max_shard_size="300B")
        weights_url = f"{args.url}/weights.pt"
        backend.save(a.model, weights_url)
        loaded = backend.load(weights_url)
        found = parallelx.latest_checkpoint(args.url)
        b = Run(backend, "adamw", init_seed=99, dropout=0.0, noise=False)
        info = b.load(found)
        b.train(MORE)
        weights = {"A": a.weights(), "B": b.weights()}  # a collective under fsdp: on every rank
        if backend.is_main():
            torch.save(
                {
                    **weights,
                    "loaded": loaded,
                    "saved": saved,
                    "at_3": at_3,
                    "found": str(found),
                    "step": info["counters"]["global_step"],
                    "world_size": backend.world_size,
                    "full_disk": full_disk,
                    "pretrained": [str(f) for f in pretrained],
                },
                args.out / "result.pt",
            )


if __name__ == "__main__":
    main()
