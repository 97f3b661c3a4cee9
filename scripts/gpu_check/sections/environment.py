"""The environment section: versions, the GPUs, ``python -m parallelx env``,
and whether the installed parallelx is this checkout."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

from ..check import Fail, Outcome, Skip
from ..settings import ROOT
from .base import Steps


class EnvironmentSteps(Steps):
    def environment(self) -> None:
        self.step("environment", "versions", self._versions)
        if self.cuda:
            self.step("environment", "GPU, CUDA, NCCL and cuDNN", self._gpu, needs="cuda")
        else:
            self.skip("environment", "GPU, CUDA, NCCL and cuDNN", "CUDA only: the dry run runs on the CPU",
                      needs="cuda")
        self.step("environment", "python -m parallelx env", self._parallelx_env, need_s=20)
        self.step("environment", "installed parallelx is this checkout", self._same_source)

    def _versions(self) -> Outcome:
        import torch
        import torchvision

        import parallelx

        facts = {"python": platform.python_version(), "executable": sys.executable,
                 "torch": torch.__version__, "torchvision": torchvision.__version__,
                 "parallelx": f"{parallelx.__version__} at {Path(parallelx.__file__).parent}",
                 "cpu_cores": os.cpu_count()}
        for dist in ("deepspeed", "horovod"):
            facts[dist] = _dist_version(dist)
        self.facts.update(facts)
        return Outcome(f"torch {torch.__version__}, parallelx {parallelx.__version__}, "
                       f"deepspeed {facts['deepspeed']}, horovod {facts['horovod']}")

    def _gpu(self) -> Outcome:
        import torch

        n = torch.cuda.device_count()
        gpus = [f"{torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))}, "
                f"{torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB)" for i in range(n)]
        nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else None
        facts = {"gpus": f"{n} x {gpus[0]}" if len(set(gpus)) == 1 else ", ".join(gpus),
                 "cuda": torch.version.cuda, "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
                 "cudnn": torch.backends.cudnn.version(), "driver": _nvidia_smi("driver_version"),
                 "nvcc": _nvcc_version(), "tf32_conv": torch.backends.cudnn.allow_tf32,
                 "tf32_matmul": torch.backends.cuda.matmul.allow_tf32}
        self.facts.update(facts)
        if facts["nccl"] is None:
            raise Fail("torch reports no NCCL: the ddp backend cannot use the GPUs", figures=facts)
        return Outcome(f"{facts['gpus']}; CUDA {facts['cuda']}, NCCL {facts['nccl']}, cuDNN {facts['cudnn']}, "
                       f"driver {facts['driver']}")

    def _parallelx_env(self) -> Outcome:
        res = self.runner.launch("single", ["-m", "parallelx", "env"], 1, timeout_s=self.timeout(120),
                                 log_name="parallelx-env")
        text = res.output().split("\n", 1)[-1]  # without the command line
        self.env_text = text
        if res.error():
            raise Fail(f"`python -m parallelx env` {res.error()}", log=text)
        usable = [line.split()[1] for line in text.splitlines() if line.strip().startswith("[OK]")]
        return Outcome(f"usable here: {', '.join(usable) or 'none'}")

    def _same_source(self) -> Outcome:
        import parallelx

        installed = Path(parallelx.__file__).resolve().parent
        if installed == (ROOT / "parallelx").resolve():
            raise Skip("parallelx runs from this checkout (an editable install): nothing to compare")
        differ = []
        for src_dir, dest in (("parallelx", installed), ("backends", installed / "backends"),
                              ("recipes", installed / "recipes")):
            for path in sorted((ROOT / src_dir).glob("*.py")):
                twin = dest / path.name
                if not twin.is_file() or twin.read_bytes() != path.read_bytes():
                    differ.append(f"{src_dir}/{path.name}")
        if differ:
            raise Fail(f"the installed parallelx ({installed}) differs from this checkout in {', '.join(differ[:6])}"
                       f"{' ...' if len(differ) > 6 else ''}: the wheel is stale; run scripts/gpu_wheels.py again")
        return Outcome(f"{installed} matches the checkout's sources")


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _nvidia_smi(field_name: str) -> str | None:
    try:
        res = subprocess.run(["nvidia-smi", f"--query-gpu={field_name}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip().splitlines()[0] if res.returncode == 0 and res.stdout.strip() else None


def _nvcc_version() -> str | None:
    try:
        res = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln for ln in res.stdout.splitlines() if "release" in ln]
    return lines[-1].split("release", 1)[1].strip() if lines else None
