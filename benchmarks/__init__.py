"""Benchmarks: the same training workload on every backend, through parallelx
and through hand-written plain scripts, side by side.

    python -m benchmarks.run --mode quick      # < 5 minutes on 2 CPU cores
    python -m benchmarks.run --mode full       # real hardware (NCCL on GPUs)

See ``benchmarks/README.md`` for the latest table and how to read it.
"""
