"""``python -m parallelx check``: does a training script give the same numbers
on every backend, and if not, where and why?

    python -m parallelx check -- train.py --lr 0.1
    python -m parallelx check --backends ddp,fsdp --steps 5 -- -m mypkg.train

The script runs unmodified under each backend's own launcher, and stops by
itself after a few optimizer steps (:mod:`parallelx.check.probe` records each
rank).  A one-process reference plays the N ranks (:mod:`parallelx.check.world`);
the same reference with its weights perturbed at float32 rounding measures the
script's own noise floor (:mod:`parallelx.check.analysis`).  From the Python
side: :func:`parallelx.testing.check_script`.
"""

from parallelx.check.report import COULD_NOT_RUN, DIFFERS, SAME, Diff, Finding, Report, Row

# The command (python -m parallelx check) is parallelx.check.command; the probe that the facade's
# observers carry into each launched process is parallelx.check.probe: importing this package loads neither.
__all__ = ["COULD_NOT_RUN", "DIFFERS", "SAME", "Diff", "Finding", "Report", "Row"]
