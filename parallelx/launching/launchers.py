"""How each backend's processes are started: one :class:`Launcher` per backend.

A backend declares its launcher once (``Backend.launcher``); error messages,
``python -m parallelx env``, the README's table, the tests and the benchmarks
all read the command line from there, so no launcher flag is written twice.

A launcher is a pair of command templates, one to run a module (``-m pkg.mod``)
and one to run a file::

    torchrun --nproc-per-node {n} {opts} -m {module}
    torchrun --nproc-per-node {n} {opts} {file}

``{opts}`` takes the flags a one-machine job needs to stay on the loopback
interface and on its own port (tests, benchmarks); it is empty in the form
shown to people.  ``{python}`` is ``python`` for people and this interpreter
for commands; a launcher program found beside this interpreter (a venv's
``bin/``) is used before the one on ``PATH``.
"""

from __future__ import annotations

import shlex
import shutil
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from parallelx.errors import ParallelxError

BIN = Path(sys.executable).parent


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True, kw_only=True)
class Launcher:
    """How to start ``n`` processes of a script for one backend."""

    #: The program, as users know it (``torchrun``); ``python`` for no launcher.
    name: str
    #: Command templates; placeholders: {n} {opts} {python} {module} / {file}.
    module: str
    file: str
    #: ``{opts}`` for a job on one machine over the loopback interface; {port} and {n} may appear.
    local_opts: str = ""
    #: Environment for such a job (e.g. Gloo's interface).
    local_env: Mapping[str, str] = field(default_factory=dict)
    #: False for the in-process backends (single, dp): always one process.
    multi_process: bool = True
    #: The form people usually write: "module" (``-m pkg.mod``) or "file" (``pkg/mod.py``).
    shown: str = "module"
    #: Called with the job's port after a local job ended, however it ended
    #: (a crashed rank cannot clean up what it leaves behind).
    cleanup: Callable[[int], None] | None = None

    def usage(self, target: str | None = None, n: str | int = "N") -> str:
        """The launch line shown to people, e.g. ``torchrun --nproc-per-node N -m recipes.dogcat``.
        ``target`` is ``-m module``, a file path, or None for this script."""
        kind, value = _split_target(target if target is not None else this_script())
        text = (self.module if kind == "module" else self.file).format(
            n=n, opts="", python="python", module=value, file=value, port=""
        )
        return " ".join(text.split())

    def example(self, module: str, n: str | int = "N") -> str:
        """The usual launch line for ``module`` (``recipes.dogcat``), in the form people write."""
        target = f"-m {module}" if self.shown == "module" else module.replace(".", "/") + ".py"
        return self.usage(target, n)

    def command(self, target: Sequence[str], n: int = 2, *, port: int | None = None, local: bool = True) -> list[str]:
        """argv that starts ``n`` processes of ``target`` (``["-m", "pkg.mod", *args]``
        or ``["path.py", *args]``).  ``local`` adds the loopback flags."""
        if not target:
            raise ParallelxError("launch target is empty: give ['-m', 'module', ...] or ['script.py', ...]")
        if not self.multi_process and n != 1:
            raise ParallelxError(f"{self.name} starts one process; got n={n}")
        if target[0] == "-m":
            kind, value, rest = "module", target[1], list(target[2:])
        else:
            kind, value, rest = "file", target[0], list(target[1:])
        port = free_port() if port is None else port
        opts = self.local_opts.format(n=n, port=port) if local else ""
        template = self.module if kind == "module" else self.file
        argv: list[str] = []
        for word in shlex.split(template):
            if word == "{opts}":
                argv += shlex.split(opts)
            elif word == "{python}":
                argv.append(sys.executable)
            else:
                argv.append(word.format(n=n, module=value, file=value, port=port))
        argv[0] = resolve_program(argv[0])
        return argv + rest

    def env(self, local: bool = True) -> dict[str, str]:
        return dict(self.local_env) if local else {}

    def program_path(self) -> str | None:
        """Where the launcher's program is, or None when it is not installed."""
        word = shlex.split(self.module)[0]
        if word == "{python}":
            return sys.executable
        path = resolve_program(word)
        return path if Path(path).is_file() else None


def resolve_program(name: str) -> str:
    """``name`` beside this interpreter if it is there, else from ``PATH``."""
    local = BIN / name
    if local.is_file():
        return str(local)
    return shutil.which(name) or name


def this_script() -> str:
    """How this process was started: ``-m pkg.mod`` or the script's path."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        return f"-m {spec.name.removesuffix('.__main__')}"
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c") else "your_script.py"
    return argv0


def _split_target(target: str) -> tuple[str, str]:
    target = target.strip()
    if target.startswith("-m "):
        return "module", target[3:].strip()
    return "file", target


PYTHON = Launcher(name="python", module="{python} -m {module}", file="{python} {file}", multi_process=False)
