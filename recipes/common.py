"""The command line shared by the recipes."""

from __future__ import annotations

import argparse
from pathlib import Path

from parallelx.cli import add_backend_arguments


def base_parser(prog: str, description: str, *, epochs: int, batch_size: int, lr: float) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_backend_arguments(p)
    p.add_argument("--data-dir", type=Path, required=True, help="where the dataset is (see --help of each recipe)")
    p.add_argument("--epochs", type=int, default=epochs)
    p.add_argument("--batch-size", type=int, default=batch_size, help="images per process per step")
    p.add_argument("--lr", type=float, default=lr, help="learning rate")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-workers", type=int, default=None,
                   help="data-loader workers per process (default: this process's share of the cores, minus one)")
    p.add_argument("--max-steps", type=int, default=None, help="cap on training steps per epoch (quick runs)")
    p.add_argument("--out-dir", type=Path, default=None, help="where outputs go (default: runs/<recipe>-<backend>)")
    return p
