"""``python -m parallelx env``: what is installed here and which backends can run.

Each backend is checked in a fresh subprocess (importing DeepSpeed or a
mis-built Horovod can be slow or crash), the way ``ds_report`` and
``horovodrun --check-build`` do for their own packages.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from .environments import detect_environment
from .errors import LaunchError
from .registry import available_backends, backend_class, detect_backend
from .runner import unavailable


def _probe(code: str, timeout: float = 120.0) -> tuple[bool, str]:
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=False
        )
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
        reason = unavailable(cls)
        if reason is not None:
            rows.append((name, False, reason, launch))
        elif cls.probe_code:
            ok, detail = _probe(cls.probe_code)
            rows.append((name, ok, detail, launch))
        else:
            rows.append((name, True, "ok", launch))
    return rows


def versions() -> dict[str, str | None]:
    """Python's version and those of the packages parallelx works with (None:
    not installed), read from their metadata: nothing heavy is imported."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("torch", "torchvision", "deepspeed", "horovod", "ray", "parallelx"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def hardware() -> dict[str, Any]:
    """The machine a measurement ran on: CPU model, the cores this process may
    use (its affinity, not the machine's count), memory, the GPUs' names."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")),
        platform.processor() or platform.machine(),
    )
    pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return {
        "arch": platform.machine(),
        "cpu": cpu,
        "os": platform.platform(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * pages / 2**30, 1) if pages else None,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else [],
    }


def cluster_lines() -> list[str]:
    """The cluster environment detected here, why, the world it forms and the
    backend ``--backend auto`` picks; an environment whose variables do not
    add up says so instead of a world."""
    env = detect_environment()
    lines = [f"cluster environment: {env.name} ({env.why()}); --backend auto picks {detect_backend()}"]
    try:
        w = env.world()
    except LaunchError as exc:
        return [*lines, f"  no world: {exc}"]
    where = f", rendezvous {w.master_addr}:{w.master_port}" if w.master_addr else ""
    owner = f"; the process group is {env.name}'s (adopted, left to it)" if env.owns_process_group else ""
    return [
        *lines,
        f"  this process: rank {w.rank} of {w.world_size}, local rank {w.local_rank} of "
        f"{w.local_world_size}{where}{owner}",
    ]


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
    print(
        f"nccl        {'yes' if cuda and torch.distributed.is_nccl_available() else 'no'}; "
        f"gloo {'yes' if torch.distributed.is_gloo_available() else 'no'}"
    )
    print()
    for line in cluster_lines():
        print(line)
    print("\nbackends:")
    for name, ok, detail, launch in report():
        print(f"  [{'OK' if ok else '--'}] {name:<10} {detail}")
        if launch:
            print(f"       {'':<10} launch: {launch}")
    return 0
