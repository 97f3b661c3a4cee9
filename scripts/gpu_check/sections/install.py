"""The install section: what gpu_check.sh installed, and Horovod built from
its sdist with NCCL operations in the background while the rest runs."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ..check import Fail, Outcome, Skip
from ..launching import NoLauncher, kill_group, unavailable
from ..report import FAILED, PASSED, Item
from ..settings import ENTRY, HOROVOD_CHECKS_S, RESERVE_S
from .base import Steps


class InstallSteps(Steps):
    def install_steps(self) -> None:
        """Items for what gpu_check.sh did before this script started (a TSV: name, status, seconds, detail)."""
        path = self.args.install_steps
        if path is None:
            self.skip("install", "carried wheels", "not started through scripts/gpu_check.sh: nothing installed")
            return
        for row in Path(path).read_text().splitlines():
            name, rc, seconds, detail = (row.split("\t") + ["", "", "", ""])[:4]
            ok = rc.strip() == "0"
            self.record(Item("install", name, PASSED if ok else FAILED,
                             detail if ok else f"exit status {rc}: {detail}", seconds=float(seconds or 0)))

    def start_horovod_build(self) -> None:
        """Horovod has no wheel for current torch: build its carried sdist with
        NCCL operations in the background (at low priority) while the other
        checks use the GPU; its own checks run at the end if it finished."""
        name = "Horovod built with NCCL operations"
        if not self.cuda:
            self.skip("install", name, "CUDA only: the NCCL build needs a GPU and nvcc"
                      + (" (the dry run uses the Horovod already installed)" if not unavailable("horovod") else ""),
                      needs="cuda")
            return
        if importlib.util.find_spec("horovod") is not None:
            self.skip("install", name, "Horovod is already installed here; its build was not repeated")
            return
        sdist = self.args.horovod_sdist
        if sdist is None or not Path(sdist).is_file():
            self.skip("install", name, f"no Horovod sdist at {sdist}: run scripts/gpu_wheels.py and carry gpu-wheels/")
            return
        if shutil.which("nvcc") is None:
            self.skip("install", name, "nvcc is not on PATH: the NCCL build needs the CUDA compiler")
            return
        log = self.runner.logs / "horovod-build.log"
        cmd = [sys.executable, str(ENTRY), "--build-horovod", str(Path(sdist).resolve()),
               "--wheel-dir", str(self.horovod_wheels)]
        print(f"[gpu-check] install / building Horovod in the background (log {log})", flush=True)
        self.horovod_started = time.monotonic()
        self.horovod_log = log
        with log.open("w") as log_file:  # the child keeps its own copy of the descriptor
            self.horovod_build = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=self.work,
                                                  start_new_session=True, preexec_fn=lambda: os.nice(10),
                                                  env=self.runner.env(NoLauncher(), 600))

    def finish_horovod_build(self) -> None:
        """Wait for the background build while time is left for Horovod's own checks, then install it."""
        proc = self.horovod_build
        if proc is None:
            return
        name = "Horovod built with NCCL operations"

        def finish() -> Outcome:
            wait_s = self.remaining() - RESERVE_S - HOROVOD_CHECKS_S
            try:
                rc = proc.wait(timeout=max(1.0, wait_s))
            except subprocess.TimeoutExpired:
                kill_group(proc)
                raise Skip(f"the build had not finished after {time.monotonic() - self.horovod_started:.0f}s, "
                           f"and Horovod's checks need the last {HOROVOD_CHECKS_S:.0f}s of the budget; "
                           "Horovod was not checked") from None
            log = self.horovod_log.read_text(errors="replace")
            if rc != 0:
                raise Fail(f"the build exited with status {rc}", log=log)
            wheels = sorted(self.horovod_wheels.glob("horovod-*.whl"))
            if not wheels:
                raise Fail(f"the build wrote no wheel into {self.horovod_wheels}", log=log)
            target = ["--target", self.args.site, "--upgrade"] if self.args.site else []
            res = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps",
                                  "--disable-pip-version-check", *target, str(wheels[-1])],
                                 capture_output=True, text=True)
            if res.returncode != 0:
                raise Fail(f"pip could not install {wheels[-1].name}", log=res.stdout + res.stderr)
            # nccl_built() is NCCL's version code, 0 without NCCL.
            probe = subprocess.run([sys.executable, "-c", "import horovod.torch as h; print(h.nccl_built())"],
                                   capture_output=True, text=True, cwd=self.work,
                                   env=self.runner.env(NoLauncher(), 60))
            code = probe.stdout.strip().splitlines()[-1:]
            if probe.returncode != 0 or not code or not code[0].isdigit() or int(code[0]) == 0:
                raise Fail("the built Horovod does not load with NCCL operations (horovod.torch.nccl_built())",
                           log=probe.stdout + probe.stderr)
            return Outcome(f"{wheels[-1].name}, NCCL operations built (NCCL {code[0]}), "
                           f"in {time.monotonic() - self.horovod_started:.0f}s")

        self.step("install", name, finish, needs="cuda")
