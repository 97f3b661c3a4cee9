"""How the GPU check starts processes: each backend under its own launcher,
from the scratch folder, with the output in a log and a timeout that kills
the whole process group."""

from __future__ import annotations

import importlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .settings import ROOT, Settings


@dataclass
class Launched:
    rc: int | None  # None: killed at its timeout
    log: Path
    seconds: float
    timeout_s: float

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.is_file() else ""

    def error(self) -> str | None:
        if self.rc == 0:
            return None
        if self.rc is None:
            return f"timed out after {self.timeout_s:.0f}s and was killed"
        return f"exited with status {self.rc}"


class Runner:
    """Starts launches the way a user would: each backend's own launcher, from
    a folder outside the checkout (so the installed parallelx is the one that
    runs), with ``benchmarks`` and the top-level ``recipes`` package reachable
    through a folder of links on ``PYTHONPATH`` (the checkout's root itself on
    the path would shadow the installed parallelx)."""

    def __init__(self, work: Path, settings: Settings) -> None:
        self.work, self.settings = work, settings
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.pythonpath = make_import_links(work / "pythonpath")

    def env(self, launcher: Any, timeout_s: float) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1",
            # A stalled rank fails its collectives before the launch's own timeout.
            PARALLELX_TIMEOUT=str(int(max(30, min(120, timeout_s - 10)))),
            PYTHONPATH=os.pathsep.join(filter(None, [str(self.pythonpath), os.environ.get("PYTHONPATH")])),
            PATH=os.pathsep.join(filter(None, [str(Path(sys.executable).parent), os.environ.get("PATH")])),
        )
        if self.settings.cuda:
            # One machine: NCCL's bootstrap stays on the loopback interface, as Gloo's does.
            env.setdefault("NCCL_SOCKET_IFNAME", "lo")
            nccl = nccl_dirs()
            if nccl is not None:
                env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(nccl[1]), env.get("LD_LIBRARY_PATH")]))
        elif _cuda_visible():
            env["CUDA_VISIBLE_DEVICES"] = ""  # a dry run on a GPU machine stays on the CPU
        env.update(launcher.env())
        return env

    def launch(self, backend: str, target: list[str], n: int, *, timeout_s: float, log_name: str) -> Launched:
        import parallelx
        from parallelx.launch import free_port

        spec = parallelx.backend_class(backend).launcher
        port = free_port()
        cmd = spec.command(target, n if spec.multi_process else 1, port=port)
        log = self.logs / f"{log_name}.log"
        start = time.monotonic()
        try:
            rc = run_logged(cmd, self.env(spec, timeout_s), log, timeout_s, cwd=self.work)
        finally:
            if spec.cleanup is not None:
                spec.cleanup(port)  # what a killed rank leaves behind (DeepSpeed's /dev/shm buffers)
        return Launched(rc, log, time.monotonic() - start, timeout_s)


def make_import_links(folder: Path) -> Path:
    """A folder holding only links to the checkout's ``benchmarks`` and
    ``recipes`` packages, for ``PYTHONPATH``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("benchmarks", "recipes"):
        link = folder / name
        if not link.exists():
            link.symlink_to(ROOT / name, target_is_directory=True)
    return folder


def run_logged(cmd: list[str], env: dict[str, str], log_file: Path, timeout_s: float, *, cwd: Path) -> int | None:
    """Run ``cmd`` in its own process group with its output in ``log_file``;
    its exit status, or None when it ran past ``timeout_s`` and the whole
    group was killed (a hung collective must not hang the check)."""
    with log_file.open("w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            return None
        except BaseException:  # SIGTERM from gpu_check.sh's timeout, Ctrl-C: take the launch down too
            kill_group(proc)
            raise


def kill_group(proc: subprocess.Popen[Any]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def nccl_dirs() -> tuple[Path, Path] | None:
    """(include, lib) of the NCCL that torch's wheel brings (``nvidia-nccl-*``), if any."""
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except ModuleNotFoundError:
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    base = Path(list(spec.submodule_search_locations)[0])
    if (base / "include" / "nccl.h").is_file() and any((base / "lib").glob("libnccl.so*")):
        return base / "include", base / "lib"
    return None


def unavailable(backend: str) -> str | None:
    """Why ``backend`` cannot run here (None when it can), without importing its package."""
    import parallelx

    importlib.invalidate_caches()  # Horovod may have been installed since the last look
    cls = parallelx.backend_class(backend)
    reason = cls.unavailable_reason()
    if reason is None and cls.launcher.program_path() is None:
        reason = f"its launcher `{cls.launcher.name}` is not installed; {cls.install_hint}"
    return reason


class NoLauncher:
    """The environment of a helper process that is not a launch."""

    @staticmethod
    def env() -> dict[str, str]:
        return {}
