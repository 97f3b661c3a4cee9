"""Command line: ``python -m parallelx env`` reports what is usable here."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallelx")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="print torch/CUDA versions and which backends are usable here")
    table = sub.add_parser("launchers", help="print the Markdown table of backends and their launch lines")
    table.add_argument("--module", default="recipes.dogcat", help="the module the launch lines run")
    args = parser.parse_args(argv)
    if args.command == "launchers":
        from .launch import markdown_table

        print(markdown_table(args.module), end="")
        return 0
    if args.command == "env":
        from .envreport import main as env_main

        return env_main()
    return 2


if __name__ == "__main__":
    sys.exit(main())
