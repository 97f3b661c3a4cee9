"""Benchmarks: the same training workload on every backend, through parallelx and through the plain
framework scripts, side by side (``python -m benchmarks.run``, ``python -m benchmarks.loops``; see README.md here)."""
