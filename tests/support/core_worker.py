"""One launch, every launcher-tier check that needs only a backend: the
protocol (``dist_worker``), gathering and BatchNorm (``gather_worker``),
training-state checkpoints (``trainstate_worker``), optimizer state loaded by name
(``optstate_worker``), a GPT as users train one
(``transformer_worker``) and the training-loop options (``loop_worker``), one after the other on the same backend, so each
backend case costs one launch instead of four.

    torchrun --nproc-per-node 2 tests/support/core_worker.py --backend ddp --out DIR [--load-from DIR]

Each section runs its worker's own ``main()`` and writes into ``DIR/<section>/``
what that worker writes when it is launched alone (each still can be).  The
backend is initialised once; the sections' ``with backend:`` and
``shutdown()`` leave it running, and it is shut down once at the end.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import dist_worker
import gather_worker
import loop_worker
import optstate_worker
import trainstate_worker
import transformer_worker

import parallelx

# trainstate before loops: the loop section changes the backend's loop options as it goes.
SECTIONS = {
    "dist": dist_worker,
    "gather": gather_worker,
    "trainstate": trainstate_worker,
    "optstate": optstate_worker,
    "transformer": transformer_worker,
    "loops": loop_worker,
}


def main() -> int:
    p = argparse.ArgumentParser()
    parallelx.add_arguments(p)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--load-from", type=Path, default=None)
    args, _ = p.parse_known_args()
    # The sections' own parsers see this launch's arguments (the deepspeed
    # launcher's --local_rank included) with their own --out.
    passed, skip = [], False
    for arg in sys.argv[1:]:
        if skip or arg in ("--out", "--load-from"):
            skip = not skip
            continue
        passed.append(arg)
    backend = parallelx.from_args(args)
    backend.init()
    shutdown = backend.shutdown
    backend.shutdown = lambda: None  # type: ignore[method-assign]
    parallelx.from_args = lambda _args: backend  # type: ignore[assignment]
    for name, worker in SECTIONS.items():
        extra = ["--load-from", str(args.load_from)] if name == "trainstate" and args.load_from else []
        (args.out / name).mkdir(parents=True, exist_ok=True)
        sys.argv = [sys.argv[0], *passed, "--out", str(args.out / name), *extra]
        print(f"core_worker: rank {backend.rank}: section {name}", flush=True)
        worker.main()
    backend.shutdown = shutdown  # type: ignore[method-assign]
    backend.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(parallelx.exit_on_error(main)())
