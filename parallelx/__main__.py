"""Command line: ``python -m parallelx env`` reports what is usable here."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallelx")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="print torch/CUDA versions and which backends are usable here")
    args = parser.parse_args(argv)
    if args.command == "env":
        from .envreport import main as env_main

        return env_main()
    return 2


if __name__ == "__main__":
    sys.exit(main())
