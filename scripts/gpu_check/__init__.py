"""The GPU check: parallelx's paths that only run on CUDA, checked in one command
(``bash scripts/gpu_check.sh`` there, ``scripts/gpu_check.py --dry-run`` on a CPU;
docs/gpu-check.md says what it checks).

Every step has a timeout, the run a deadline, and the report is rewritten
after every step, so that a run cut short still says how far it got.
``check.py`` holds the settings and the machinery, ``sections.py`` the steps,
``workers.py`` what runs in the processes the check starts.
"""
