"""Start real launchers (torchrun, horovodrun, deepspeed) from tests, with a
hard timeout that kills the whole process tree: a hung collective fails its
test instead of hanging the run."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Result:
    returncode: int
    output: str
    seconds: float

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.output.splitlines()[-n:])


def launcher_command(launcher: str, target: list[str], nproc: int = 2) -> list[str]:
    """``target`` is ``["-m", "module", args...]`` or ``["path.py", args...]``."""
    if launcher == "python":
        return [sys.executable, *target]
    if launcher == "torchrun":
        return [str(BIN / "torchrun"), "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
                "--master-port", str(free_port()), *target]
    if launcher == "horovodrun":
        return [str(BIN / "horovodrun"), "-np", str(nproc), "-H", f"localhost:{nproc}", "--gloo",
                "--network-interface", "lo", sys.executable, *target]
    if launcher == "deepspeed":
        # The deepspeed launcher runs a script path (or --module), not "-m".
        if target[0] == "-m":
            target = ["--module", *target[1:]]
        return [str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(free_port()), *target]
    raise ValueError(launcher)


def launch(launcher: str, target: list[str], *, nproc: int = 2, timeout: float = 240,
           env: dict[str, str] | None = None) -> Result:
    cmd = launcher_command(launcher, target, nproc)
    full_env = dict(os.environ)
    # PYTHONFAULTHANDLER: a rank killed by a signal (a native abort) prints its Python stacks.
    full_env.update(GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1", PARALLELX_TIMEOUT="120", PYTHONFAULTHANDLER="1",
                    PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    full_env.update(env or {})
    start = time.monotonic()
    try:
        return _run(launcher, cmd, full_env, timeout, start)
    finally:
        if launcher == "deepspeed":
            # A crashed or killed rank cannot remove its DeepSpeed /dev/shm buffer.
            from backends.deepspeed import remove_shm_buffers

            remove_shm_buffers(cmd[cmd.index("--master_port") + 1])


def _run(launcher: str, cmd: list[str], full_env: dict[str, str], timeout: float, start: float) -> Result:
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{launcher} job hung for more than {timeout:.0f}s and was killed:\n"
                    + "\n".join(out.splitlines()[-40:]))
    return Result(proc.returncode, out, time.monotonic() - start)


def require_launcher(launcher: str) -> None:
    """Skip only when the launcher is genuinely not installed (never in CI,
    whose set-up installs all of them)."""
    exe = {"torchrun": "torchrun", "horovodrun": "horovodrun", "deepspeed": "deepspeed"}.get(launcher)
    if exe and not (BIN / exe).exists():
        if os.environ.get("CI"):
            pytest.fail(f"{exe} is not installed; run scripts/setup.sh")
        pytest.skip(f"{exe} is not installed")
