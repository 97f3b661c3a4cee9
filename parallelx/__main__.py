"""Command line of parallelx itself.

    python -m parallelx env                         # what is installed here, which backends can run
    python -m parallelx launchers                   # the table of backends and their launch lines
    python -m parallelx launch ddp -n 2 -- -m recipes.cifar10 --data-dir data/cifar10
                                                    # start N local processes with the backend's own launcher
"""

from __future__ import annotations

import argparse
import sys

from . import envreport
from .cli import exit_on_error
from .errors import ParallelxError
from .registry import backend_class, markdown_table
from .runner import launch


@exit_on_error
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallelx")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="print torch/CUDA versions and which backends are usable here")
    table = sub.add_parser("launchers", help="print the Markdown table of backends and their launch lines")
    table.add_argument("--module", default="recipes.dogcat", help="the module the launch lines run")
    run = sub.add_parser("launch", help="start a script on this machine with a backend's own launcher",
                         description="Builds the launcher's command line (loopback interface, a free port) and "
                                     "runs it; --backend NAME is added to the script's arguments.")
    run.add_argument("backend", help="single, dp, ddp, horovod, deepspeed")
    run.add_argument("-n", "--nproc", type=int, default=2, help="processes to start (default 2)")
    run.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    argv = sys.argv[1:] if argv is None else list(argv)
    # Everything after "--" is the script's (argparse's REMAINDER would also swallow -n and --dry-run).
    target = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.command == "launchers":
        print(markdown_table(args.module), end="")
        return 0
    if args.command == "env":
        return envreport.main()
    return _launch(args.backend, args.nproc, target, dry_run=args.dry_run)


def _launch(name: str, nproc: int, target: list[str], *, dry_run: bool) -> int:

    if not target:
        raise ParallelxError("nothing to launch: end with `-- -m package.module [args]` or `-- script.py [args]`")
    if nproc < 1:
        raise ParallelxError(f"-n must be >= 1, got {nproc}")
    cls = backend_class(name)
    spec = cls.launcher
    if spec.program_path() is None:
        raise ParallelxError(f"the {spec.name} launcher is not installed; {cls.install_hint}")
    target = [*target, "--backend", cls.name]
    if dry_run:
        print(" ".join(spec.command(target, nproc if spec.multi_process else 1)))
        return 0
    try:
        # On this terminal, no time limit: Ctrl-C reaches the launcher as from the shell.
        return launch(spec, target, nproc, timeout=None, interactive=True).returncode
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
