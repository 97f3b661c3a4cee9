"""What the sections' steps share: the scratch folder, the launches, the
background Horovod build."""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from ..check import Check
from ..launching import Runner
from ..settings import BUDGET_S, Settings


class Steps(Check):
    """The state every section's steps use; each section adds its steps to it."""

    def __init__(self, args: argparse.Namespace, settings: Settings, nproc: int) -> None:
        out = Path(args.out)
        work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpu-check-"))
        work.mkdir(parents=True, exist_ok=True)
        super().__init__(out, work.resolve(), args.deadline or time.time() + BUDGET_S, settings, nproc,
                         only=args.only)
        self.args = args
        self.runner = Runner(self.work, settings)
        self.data = self.work / "data"
        self.horovod_build: subprocess.Popen[Any] | None = None
        self.horovod_wheels = self.work / "horovod-wheel"

    @property
    def cuda(self) -> bool:
        return self.settings.cuda

    def n_for(self, backend: str) -> int:
        import parallelx

        return self.nproc if parallelx.backend_class(backend).launcher.multi_process else 1
