"""Each rank's peak memory through building and set-up of a ~200 M-parameter GPT, built eagerly,
under ``parallelx.init_module()`` (``meta``) or under plain ``torch.device("meta")`` with its init given
to ``parallelx.init_weights`` (``plain``), 2 processes on the CPU.

    torchrun --nproc-per-node 2 benchmarks/setup_peak.py --backend fsdp --build meta
    deepspeed --num_gpus 2 benchmarks/setup_peak.py --backend deepspeed --zero-stage 3 --build meta

Peak RSS growth over the interpreter after ``import torch`` and ``backend.init()`` (``VmHWM``,
which only grows), after the build, after ``backend.wrap_model`` (the weights in place: under
DeepSpeed the engine is built at the optimizer) and after ``backend.wrap_optimizer(AdamW)`` (the
whole set-up, no step); rank 0 prints one JSON line per rank.  The model: ``tests/support/gpt.py``'s GPT, width 1024, 16 layers,
vocabulary 8192, block 256 (206 M parameters, 786 MiB of float32).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
from pathlib import Path

import torch


def peak() -> int:
    """This process's peak RSS in bytes: ``VmHWM`` on Linux.  ``ru_maxrss`` would also do, but it keeps
    the launcher's RSS at the fork (and any peak before ``execve``), which can hide growth after it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # KiB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


AFTER_TORCH = peak()  # the baseline: after import torch

from torch import nn  # noqa: E402

import parallelx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from gpt import GPT, Config  # noqa: E402

CFG = Config(vocab=8192, block=256, layers=16, heads=16, width=1024)
MIB = 1024 * 1024


def init_gpt(model: nn.Module) -> None:
    """What the GPT's ``__init__`` does beyond its layers' ``reset_parameters``."""
    model.apply(GPT._init)
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight"):
            nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * CFG.layers))
    nn.init.ones_(model.logit_scale)
    nn.init.zeros_(model.frozen_shift)


def main() -> int:
    p = argparse.ArgumentParser()
    parallelx.add_arguments(p)
    p.add_argument("--build", choices=("eager", "meta", "plain"), default="meta")
    args, _ = p.parse_known_args()
    backend = parallelx.from_args(args)
    backend.init()
    base = peak()
    torch.manual_seed(0)
    if args.build == "meta":
        with parallelx.init_module():
            model = GPT(CFG)
    elif args.build == "plain":
        with torch.device("meta"):
            model = GPT(CFG)
        parallelx.init_weights(model, init_gpt)
    else:
        model = GPT(CFG)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    built = peak()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model = backend.wrap_model(model)  # the weights in place (DeepSpeed builds its engine at the optimizer)
    wrapped = peak()
    backend.wrap_optimizer(optimizer)
    set_up = peak()
    row = {
        "backend": backend.name,
        "argv": " ".join(sys.argv[1:]),
        "build": args.build,
        "rank": backend.rank,
        "model_mib": round(model_bytes / MIB),
        "build_peak_mib": round((built - base) / MIB),
        "wrap_model_peak_mib": round((wrapped - base) / MIB),
        "setup_peak_mib": round((set_up - base) / MIB),
        "setup_peak_x_model": round((set_up - base) / model_bytes, 3),
        # The same from right after ``import torch``: parallelx's and the engine's imports, the process
        # group and torch's first meta build (sympy, 165 MiB) included.
        "setup_peak_from_torch_mib": round((set_up - AFTER_TORCH) / MIB),
        "setup_peak_from_torch_x_model": round((set_up - AFTER_TORCH) / model_bytes, 3),
    }
    rows = backend.all_gather_object(row)
    if backend.rank == 0:
        for r in rows:
            print("setup_peak:", json.dumps(r), flush=True)
    backend.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
