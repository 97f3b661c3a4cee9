"""Helpers for users' own test suites.

:func:`check_script` runs ``python -m parallelx check`` from Python and
returns its :class:`Report`, for a CI job that proves a training script gives
the same numbers on every backend::

    from parallelx.testing import check_script

    def test_train_py_is_backend_independent():
        report = check_script("train.py", "--lr", "0.1", backends=["ddp", "fsdp"])
        assert report.same, report.render()
"""

from __future__ import annotations

from parallelx.check.command import check_script
from parallelx.check.report import COULD_NOT_RUN, DIFFERS, SAME, Finding, Report

__all__ = ["COULD_NOT_RUN", "DIFFERS", "SAME", "Finding", "Report", "check_script"]
