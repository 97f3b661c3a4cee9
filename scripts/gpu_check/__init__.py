"""The GPU check: parallelx's paths that only run on CUDA, checked in one command
(``bash scripts/gpu_check.sh`` there, ``scripts/gpu_check.py --dry-run`` on a CPU;
the README's "GPU check" says what it checks).

Its sections: **install** (the carried wheels; Horovod built with NCCL in the
background), **environment**, **recipes** (both recipes under every
launcher, val figures against a single-process evaluation of ``best.pth``),
**throughput** (``benchmarks/same_process.py`` on VGG16) and **host-sync**
(synchronisations per step of the recipes' loop).  Every step has a timeout,
the run a deadline, and the report is rewritten after every step.
``check.py`` holds the settings and the machinery, ``sections.py`` the steps,
``workers.py`` what runs in the processes the check starts.
"""
