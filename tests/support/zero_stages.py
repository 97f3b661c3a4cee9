"""Run a DeepSpeed-launched script once per ZeRO stage in one launch: the script's own ``main`` with
``--stage S --out DIR/zeroS`` for each stage of ``--stages``, in a process group made first, which
each run's engine (plain DeepSpeed or parallelx's backend) adopts and leaves.  One DeepSpeed start
(its import, the launcher, the CPU op) serves every stage: the tests' time, not their checks.

    deepspeed --num_gpus 2 tests/support/zero_stages.py tests/support/ds_tutorial_port.py --stages 0 1 2 3 \\
        --out DIR --backend deepspeed

The script must define ``add_argument()`` (reading ``sys.argv``) and ``main(args)``, as DeepSpeed's
tutorial does; every other argument is passed to it unchanged.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

import deepspeed


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("script", type=Path)
    parser.add_argument("--stages", type=int, nargs="+", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args, rest = parser.parse_known_args()
    spec = importlib.util.spec_from_file_location(args.script.stem, args.script)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    os.environ.setdefault(
        "TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[2] / ".venv" / "torch_extensions")
    )
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    for stage in args.stages:
        out = args.out / f"zero{stage}"
        out.mkdir(parents=True, exist_ok=True)
        sys.argv = [str(args.script), *rest, "--stage", str(stage), "--out", str(out)]
        print(f"zero_stages: {args.script.name} at ZeRO-{stage}", flush=True)
        script.main(script.add_argument())
    return 0


if __name__ == "__main__":
    sys.exit(main())
