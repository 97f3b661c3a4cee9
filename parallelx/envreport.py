"""``python -m parallelx env``: what is installed here and which backends can run.

Each backend is checked in a fresh subprocess (importing DeepSpeed or a
mis-built Horovod can be slow or crash), the way ``ds_report`` and
``horovodrun --check-build`` do for their own packages.
"""

from __future__ import annotations

import platform
import subprocess
import sys

import torch

from .registry import available_backends, backend_class

def _probe(code: str, timeout: float = 120.0) -> tuple[bool, str]:
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"import timed out after {timeout:.0f}s"
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        return False, lines[-1] if lines else f"exit code {proc.returncode}"
    out = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    return True, out[-1] if out else "ok"


def report() -> list[tuple[str, bool, str, str]]:
    """``(backend, usable, detail, launch line)`` for every registered backend."""
    rows = []
    for name in available_backends():
        if name == "auto":
            continue
        try:
            cls = backend_class(name)
        except Exception as exc:  # a broken third-party entry point
            rows.append((name, False, f"cannot load: {exc}", ""))
            continue
        launch = cls.launcher.usage("-m your.module")
        reason = cls.unavailable_reason()
        if reason is None and cls.launcher.program_path() is None:
            reason = f"its launcher `{cls.launcher.name}` is not installed; {cls.install_hint}"
        if reason is not None:
            rows.append((name, False, reason, launch))
        elif cls.probe_code:
            ok, detail = _probe(cls.probe_code)
            rows.append((name, ok, detail, launch))
        else:
            rows.append((name, True, "ok", launch))
    return rows


def main() -> int:
    print(f"python      {platform.python_version()} ({platform.machine()})")
    print(f"torch       {torch.__version__} (CUDA build {torch.version.cuda or 'none'})")
    try:
        import torchvision

        print(f"torchvision {torchvision.__version__}")
    except ImportError:
        print("torchvision not installed")
    cuda = torch.cuda.is_available()
    print(f"cuda        {'available, ' + str(torch.cuda.device_count()) + ' device(s)' if cuda else 'not available'}")
    print(f"nccl        {'yes' if cuda and torch.distributed.is_nccl_available() else 'no'}; "
          f"gloo {'yes' if torch.distributed.is_gloo_available() else 'no'}")
    print("\nbackends:")
    for name, ok, detail, launch in report():
        print(f"  [{'OK' if ok else '--'}] {name:<10} {detail}")
        if launch:
            print(f"       {'':<10} launch: {launch}")
    return 0
