"""Backend names, lookup and launcher detection.

A backend is a :class:`~parallelx.strategy.Strategy` subclass described by a
:class:`~parallelx.strategy.BackendSpec` (:func:`describe`); :func:`get_backend`
puts one inside the :class:`~parallelx.Backend` facade.  Built-in backends are
listed by module path, so nothing is imported until a backend is asked for.
Third-party backends register through the ``parallelx.backends`` entry-point
group (``name = "pkg.module:Class"``) or at run time with :func:`register_backend`.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Mapping, Sequence
from importlib.metadata import entry_points
from typing import Any

from parallelx.backend import Backend
from parallelx.errors import BackendUnavailableError, UnknownBackendError
from parallelx.launching.environments import detect_environment
from parallelx.log import info, warn
from parallelx.strategy import BackendSpec, Options, Strategy

ENTRY_POINT_GROUP = "parallelx.backends"

_BUILTIN: dict[str, str] = {
    "single": "parallelx.backends.single:SingleStrategy",
    "dp": "parallelx.backends.dp:DataParallelStrategy",
    "ddp": "parallelx.backends.ddp:DDPStrategy",
    "horovod": "parallelx.backends.horovod:HorovodStrategy",
    "deepspeed": "parallelx.backends.deepspeed:DeepSpeedStrategy",
    "fsdp": "parallelx.backends.fsdp:FSDPStrategy",
}
_REGISTERED: dict[str, str | type[Strategy]] = {}


def register_backend(name: str, target: str | type[Strategy]) -> None:
    """Make ``name`` available to :func:`get_backend`; ``target`` is a
    :class:`~parallelx.strategy.Strategy` subclass or a ``"module:Class"`` path imported on first use."""
    _REGISTERED[name] = target


def _entry_points() -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def _table() -> dict[str, str | type[Strategy]]:
    table: dict[str, str | type[Strategy]] = dict(_BUILTIN)
    for name, value in _entry_points().items():
        table.setdefault(name, value)
    table.update(_REGISTERED)
    return table


def available_backends() -> list[str]:
    """Every backend name :func:`get_backend` accepts (``auto`` included)."""
    return [*_table(), "auto"]


def backend_class(name: str) -> type[Strategy]:
    """The strategy registered as ``name`` (imports its module, which never
    imports the backend's heavy package).  ``auto`` is the one the launcher of
    this process was meant for (see :func:`detect_backend`)."""
    if name == "auto":
        name = detect_backend()
    table = _table()
    if name not in table:
        raise UnknownBackendError(f"unknown backend {name!r}; valid backends are: {', '.join(available_backends())}")
    target = table[name]
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        target = getattr(importlib.import_module(module), attr)
    if not (isinstance(target, type) and issubclass(target, Strategy)):
        raise UnknownBackendError(
            f"backend {name!r} resolves to {target!r}, which is not a parallelx.strategy.Strategy subclass"
        )
    return target


def describe(name: str) -> BackendSpec:
    """The backend ``name`` as a record: its launcher, environments, install hint, probe."""
    return backend_class(name).spec


def detect_backend(environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None) -> str:
    """The backend the cluster environment of this process means.

    The environment (:func:`parallelx.launching.environments.detect_environment`) names
    its backend: torchrun and plain ``RANK``/``WORLD_SIZE`` variables ->
    ``ddp``, horovodrun -> ``horovod``, the deepspeed launcher -> ``deepspeed``,
    none -> ``dp`` with several GPUs, else ``single``.  A third-party backend
    whose ``detect()`` scores the environment above 0 wins over that.
    """
    env = os.environ if environ is None else environ
    args = sys.argv if argv is None else argv
    best, best_score = detect_environment(env, args).auto_backend(), 0
    for name in _table():
        if name in _BUILTIN:
            continue  # built-in backends leave the choice to the environment
        try:
            score = backend_class(name).detect(env, args)
        except ImportError:
            continue
        if score > best_score:
            best, best_score = name, score
    return best


def get_backend(name: str = "auto", **options: Any) -> Backend:
    """Create the backend called ``name`` (not yet initialised: call ``init()``).

    ``auto`` picks from the launcher's environment: torchrun -> ``ddp``,
    horovodrun -> ``horovod``, the deepspeed launcher -> ``deepspeed``; with no
    launcher, ``dp`` when several GPUs are visible, else ``single``.
    ``options`` are :class:`~parallelx.strategy.Options` fields (e.g. ``timeout=60``,
    ``accumulate=4``) or the backend's own (a ZeRO stage, fsdp's units: see its module).
    Another registered backend's own option is ignored here (a ZeRO stage on ``ddp``: a
    script passes its choices whichever backend runs), and said once on rank 0; an option
    that no registered backend takes is refused, with the valid ones.
    """
    if name == "auto":
        name = detect_backend()
    cls = backend_class(name)
    reason = cls.spec.unavailable_reason()
    if reason is not None:
        raise BackendUnavailableError(f"backend {name!r} is unavailable: {reason}")
    common = {k: v for k, v in options.items() if k in Options.fields()}
    own = {k: v for k, v in options.items() if k not in common}
    accepted = own_options(cls)
    if accepted is not None and (foreign := {k: v for k, v in own.items() if k not in accepted}):
        owners = option_owners()
        unknown = [k for k in foreign if k not in owners]
        if unknown:
            valid = sorted(Options.fields() | accepted)
            raise UnknownBackendError(
                f"backend {name!r} does not accept {', '.join(repr(k) for k in unknown)}, and no registered "
                f"backend does; its options are: {', '.join(valid)}; the other backends' own: "
                f"{', '.join(sorted(owners))}"
            )
        # A script passes its own choice (a ZeRO stage) on whichever backend runs: the backends it
        # does not concern ignore it, as they ignore that backend's command-line options.
        _note_ignored(name, {k: owners[k] for k in foreign})
        _warn_math(name, foreign, owners)
        own = {k: v for k, v in own.items() if k in accepted}
    try:
        strategy = cls(**own)
    except TypeError as exc:
        raise UnknownBackendError(f"backend {name!r} does not accept these options: {exc}") from None
    return Backend(strategy, Options(**common))


def own_options(cls: type[Strategy]) -> frozenset[str] | None:
    """The keyword options ``cls``'s constructor takes (None: any, it has ``**kwargs``)."""
    if cls.__init__ is object.__init__:
        return frozenset()
    params = inspect.signature(cls.__init__).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self")


def option_owners() -> dict[str, list[str]]:
    """Each registered backend's own constructor option, with the backends that take it."""
    owners: dict[str, list[str]] = {}
    for name in _table():
        try:
            accepted = own_options(backend_class(name))
        except (ImportError, UnknownBackendError):  # a broken third-party backend names nothing
            continue
        for option in sorted(accepted or ()):
            owners.setdefault(option, []).append(name)
    return owners


_noted: set[str] = set()


def _note_ignored(name: str, ignored: Mapping[str, list[str]]) -> None:
    """One line, once per process, on rank 0 only: which options this backend leaves to others."""
    msg = "; ".join(f"{k} is {', '.join(owners)}'s" for k, owners in ignored.items())
    msg = f"parallelx: {name} ignores options of other backends ({msg})"
    if msg in _noted:
        return
    _noted.add(msg)
    if _launcher_rank() == 0:
        info(msg)


def _launcher_rank() -> int:
    """This process's rank as its launcher set it (before init(), which parallelx's log needs)."""
    try:
        return detect_environment().world().rank
    except Exception:  # a half-set launcher environment: init() says what is wrong, not this line
        return 0


def _warn_math(name: str, foreign: Mapping[str, Any], owners: Mapping[str, list[str]]) -> None:
    """A warning where an option this backend ignores would have changed the update on the backend
    that takes it (a DeepSpeed config's gradient_clipping): the same command must not clip on one
    backend and not on another without a word."""
    said: list[str] = []
    for owner in sorted({o for k in foreign for o in owners[k]}):
        mine = {k: v for k, v in foreign.items() if owner in owners[k]}
        try:
            said += [s for s in backend_class(owner).ignored_elsewhere(mine) if s not in said]
        except ImportError:
            continue
    if said and _launcher_rank() == 0:
        warn(f"{name} ignores {'; '.join(said)}")


def markdown_table(module: str = "recipes.dogcat") -> str:
    """The README's table of backends: name, launch line, what runs."""
    rows = ["| backend | launch | what runs |", "|---|---|---|"]
    for name in available_backends():
        if name == "auto":
            continue
        spec = describe(name)
        rows.append(f"| `{name}` | `{spec.launcher.example(module)} --backend {name}` | {spec.summary} |")
    return "\n".join(rows) + "\n"
