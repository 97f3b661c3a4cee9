"""Running a backend's launcher from Python: N local processes, a hard timeout, the output kept.

``python -m parallelx launch``, the test suite, the benchmarks and the GPU
check all start jobs this way, so that a hung collective is handled the same
everywhere::

    from parallelx import backend_class

    from parallelx.launching import runner

    done = runner.launch(backend_class("ddp").launcher, ["-m", "recipes.cifar10"], 2, timeout=600)
    if done.timed_out or done.returncode:
        print(done.tail())

A job runs in its own process group: at the timeout the whole group is killed,
since a launcher that is killed alone leaves its workers waiting in a
collective for ever.  The launcher's clean-up hook (``Launcher.cleanup``) runs
after every launch, however it ended, because a killed rank cannot remove
what it leaves behind (DeepSpeed's shared-memory buffers).

Only :mod:`parallelx.launching.launchers` and :mod:`parallelx.errors` are imported here, so
that the command line and the harnesses can use it without import circles.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from parallelx.launching.launchers import BIN, Launcher, free_port


@dataclass(frozen=True)
class Finished:
    """How a job ended."""

    command: list[str]
    returncode: int  # negative: ended by that signal (at a timeout, SIGKILL's)
    output: str  # stdout and stderr together, in order; "\r" (a progress bar's redraw) read as a line end
    seconds: float
    timed_out: bool  # it ran past its timeout and its process group was killed

    def tail(self, n: int = 60) -> str:
        """The last ``n`` lines: where a failed job says why."""
        return "\n".join(self.output.splitlines()[-n:])

    def error(self) -> str | None:
        """None when the job succeeded, else how it failed, in words."""
        if self.timed_out:
            return f"timed out after {self.seconds:.0f}s and was killed"
        return None if self.returncode == 0 else f"exited with status {self.returncode}"


class Runnable(Protocol):
    """What :func:`unavailable` reads: a backend's description (:class:`parallelx.strategy.BackendSpec`),
    or a stand-in for a framework that is not one."""

    @property
    def launcher(self) -> Launcher: ...
    @property
    def install_hint(self) -> str: ...

    def unavailable_reason(self) -> str | None: ...


def unavailable(spec: Runnable) -> str | None:
    """Why ``spec``'s jobs cannot start here (its package, or its launcher
    program, is missing), or None when they can; imports no heavy package."""
    reason = spec.unavailable_reason()
    if reason is None and spec.launcher.program_path() is None:
        hint = f"; {spec.install_hint}" if spec.install_hint else ""
        reason = f"its launcher `{spec.launcher.name}` is not installed{hint}"
    return reason


def job_env(launcher: Launcher | None = None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a job: this interpreter's ``bin/`` first
    on ``PATH`` (launchers start ``python`` and their own programs by name),
    unbuffered output (a killed job's last lines are the ones that explain
    it), Python's stacks on a fatal signal, the launcher's loopback settings,
    then ``extra``."""
    env = dict(os.environ)
    env.update(
        PATH=os.pathsep.join(filter(None, [str(BIN), env.get("PATH")])), PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1"
    )
    if launcher is not None:
        env.update(launcher.env())
    env.update(extra or {})
    return env


def run(
    cmd: Sequence[str],
    *,
    timeout: float | None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    log: Path | None = None,
    grace: float = 0.0,
    interactive: bool = False,
    die_with_parent: bool = False,
) -> Finished:
    """Run ``cmd`` and wait for it, at most ``timeout`` seconds.

    ``env`` is the whole environment (default: this process's), with
    ``PYTHONUNBUFFERED=1``.  The output goes to ``log`` (after a ``$ cmd``
    line) or a temporary file, and comes back as ``Finished.output``;
    ``interactive`` leaves it on this terminal and the job in this process
    group, so that Ctrl-C reaches the launcher as it would from the shell.
    At the timeout, ``grace`` > 0 first sends SIGTERM to the job's first
    process alone (a harness that runs launches of its own then ends them and
    writes what it has), then the whole group gets SIGKILL.  If this process
    is interrupted meanwhile, the job is killed before the exception goes on.
    ``die_with_parent`` has Linux send the launcher SIGTERM (which launchers
    forward to their workers) should this process die, even by SIGKILL; it
    uses ``preexec_fn``, so only from a process without threads."""
    cmd = list(cmd)
    start = time.monotonic()
    out: IO[str] | None = None
    if not interactive:
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            out = log.open("w+", errors="replace")
            out.write("$ " + shlex.join(cmd) + "\n")
            out.flush()
        else:
            out = tempfile.TemporaryFile("w+", errors="replace")  # noqa: SIM115  (closed below)
        begin = out.tell()  # where the job's own output starts
    try:
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"},
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
            start_new_session=not interactive,
            preexec_fn=_die_with_parent if die_with_parent else None,
        )
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop(proc, grace)
        except BaseException:
            _stop(proc, 2.0 if interactive else 0.0, group=not interactive)
            raise
        text = ""
        if out is not None:
            out.seek(begin)
            text = out.read()
        return Finished(cmd, proc.returncode, text, time.monotonic() - start, timed_out)
    finally:
        if out is not None:
            out.close()


def launch(
    launcher: Launcher,
    target: Sequence[str],
    nproc: int = 2,
    *,
    timeout: float | None,
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> Finished:
    """Start ``target`` (``["-m", "pkg.mod", *args]`` or ``["file.py", *args]``)
    under ``launcher`` on this machine: ``nproc`` processes (one for the
    in-process launchers), on the loopback interface and a free port, with
    :func:`job_env` plus ``env``; then the launcher's clean-up.  ``kwargs``
    are :func:`run`'s (``cwd``, ``log``, ``interactive``, ...)."""
    port = free_port()
    cmd = launcher.command(list(target), nproc if launcher.multi_process else 1, port=port)
    try:
        return run(cmd, timeout=timeout, env=job_env(launcher, env), **kwargs)
    finally:
        if launcher.cleanup is not None:
            launcher.cleanup(port)


def _stop(proc: subprocess.Popen[Any], grace: float, *, group: bool = True) -> None:
    """End ``proc``: SIGTERM and ``grace`` seconds to finish, then SIGKILL to
    its whole group (or, when it shares ours, to it alone)."""
    if grace > 0:
        if group:  # else the terminal's Ctrl-C has reached it already
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        if group:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher's workers too
        else:
            proc.kill()
    except ProcessLookupError:
        pass
    proc.wait()


def _die_with_parent() -> None:
    """In the child, before the launcher starts: PR_SET_PDEATHSIG (Linux only; elsewhere nothing)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
