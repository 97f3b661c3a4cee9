"""Run under a real launcher: the several-models examples (``examples/gan.py``,
``examples/ema.py``, ``examples/distill.py``), one after the other on one
backend, each into ``<out>/<name>/final.pt`` (see tests/launcher/test_model_examples.py).
The backend's own options (``--backend``, ``--zero-stage``) are the worker's.  Under DeepSpeed,
``--stages 0 1 2`` runs the three at each of those ZeRO stages in turn, into ``<out>/zero<S>/<name>``,
in one launch: one process group, made first, which each stage's backend adopts and leaves."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import parallelx

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ("gan", "ema", "distill")


def main() -> int:
    p = argparse.ArgumentParser()
    parallelx.add_arguments(p)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--stages", type=int, nargs="+", help="under deepspeed: each of these ZeRO stages in turn")
    args = p.parse_args()
    argv = sys.argv[1:]
    at = argv.index("--out")
    own = argv[:at] + argv[at + 2 :]  # the backend's options, which every example also takes
    if args.stages is None:
        run(args, own, args.out)
        return 0
    import deepspeed

    at = own.index("--stages")
    own = own[:at] + own[at + 1 + len(args.stages) :]
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    for stage in args.stages:
        run(args, own, args.out / f"zero{stage}", zero_stage=stage)
    return 0


def run(args: argparse.Namespace, own: list[str], out: Path, **options: int) -> None:
    """The three examples on one backend, into ``out/<name>``."""
    with parallelx.from_args(args, **options) as backend:
        for name in EXAMPLES:
            spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            example_args = module.arguments().parse_args([*own, "--out-dir", str(out / name)])
            backend.print(f"examples_worker: {name}")
            module.train(backend, example_args)


if __name__ == "__main__":
    sys.exit(parallelx.exit_on_error(main)())
