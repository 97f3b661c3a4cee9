"""Run several ``python -m parallelx.launching.ray_train`` jobs, one after the other, in one
local Ray cluster started here once (its start-up costs seconds), then stop it.

    python tests/support/ray_driver.py '[["-n", "2", "-m", "recipes.cifar10", ...], [...]]'

Exit status: the highest of the jobs'.  Ray's workers inherit this process's
environment (the cluster's raylet is started from it)."""

from __future__ import annotations

import json
import sys
import time

import ray

from parallelx.launching import ray_train as ray_launch

if __name__ == "__main__":
    jobs = json.loads(sys.argv[1])
    start = time.monotonic()
    # A new cluster of its own, even where another is running on this machine.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=True)
    print(f"ray_driver: local Ray started in {time.monotonic() - start:.1f}s", flush=True)
    codes = []
    for argv in jobs:
        start = time.monotonic()
        codes.append(ray_launch.main(argv))
        print(f"ray_driver: job {len(codes)} exit status {codes[-1]} in {time.monotonic() - start:.1f}s", flush=True)
    start = time.monotonic()
    ray.shutdown()
    print(f"ray_driver: Ray stopped in {time.monotonic() - start:.1f}s", flush=True)
    sys.exit(max(codes))
