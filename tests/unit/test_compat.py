"""The module paths of 0.3 (parallelx/_compat.py): each imports, warns and is the new module itself."""

from __future__ import annotations

import importlib
import runpy
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

import parallelx
from parallelx import _compat

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fresh_old_paths() -> Iterator[None]:
    """No old path in sys.modules (so each import runs the finder and warns), and none left behind."""

    def forget() -> None:
        for old in _compat.MOVED:
            sys.modules.pop(old, None)
            parent, _, leaf = old.rpartition(".")
            package = sys.modules.get(parent) or sys.modules.get(_compat.MOVED.get(parent, parent))
            # The import system binds an imported submodule on its parent: unbind the old names only.
            bound = getattr(package, leaf, None)
            if isinstance(bound, ModuleType) and bound.__name__ != f"{package.__name__}.{leaf}":
                delattr(package, leaf)

    forget()
    yield
    forget()


@pytest.mark.parametrize("old", sorted(_compat.MOVED))
def test_old_path_imports_warns_and_is_the_new_module(old, fresh_old_paths):
    new = _compat.MOVED[old]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__name__ == new and module.__spec__.name == new  # the module keeps its own identity
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert any(old in m and new in m for m in messages), messages


def test_the_warning_points_at_the_importing_line(fresh_old_paths):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import parallelx.trainstate  # type: ignore[import-not-found]  # noqa: F401
    assert [(Path(w.filename), w.category) for w in caught] == [(Path(__file__), DeprecationWarning)]


def test_from_imports_and_classes_are_one_copy(fresh_old_paths):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from parallelx import trainstate  # type: ignore[attr-defined]
        from parallelx.environments.slurm import Slurm as OldSlurm  # type: ignore[import-not-found]
        from parallelx.tracking import monitor  # type: ignore[attr-defined]
    from parallelx.checkpoints import trainstate as new_trainstate
    from parallelx.launching.environments.slurm import Slurm
    from parallelx.observability import monitor as new_monitor

    assert trainstate is new_trainstate
    assert OldSlurm is Slurm
    assert monitor is new_monitor
    assert trainstate.save_training_state is parallelx.save_training_state


def test_every_new_path_exists_and_no_old_module_is_left_in_the_tree():
    for old, new in _compat.MOVED.items():
        assert importlib.util.find_spec(new) is not None, new
        old_file = ROOT / Path(*old.split("."))
        assert not old_file.with_suffix(".py").exists() and not old_file.is_dir(), f"{old} is still in the tree"


def test_paths_that_never_existed_are_not_invented():
    assert _compat.new_name("parallelx.backend") is None
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("parallelx.no_such_module")


def test_python_dash_m_old_path_runs_the_new_module(fresh_old_paths, monkeypatch, capsys):
    """``python -m parallelx.ray --help``, in-process: runpy asks the old path's loader for the code
    (runpy.run_module takes the same path as ``-m``; tests/system/test_wheel.py runs the real
    ``python -m parallelx.ray --help`` against the installed wheel)."""
    monkeypatch.setattr(sys, "argv", ["parallelx.ray", "--help"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(SystemExit) as done:
            runpy.run_module("parallelx.ray", run_name="__main__", alter_sys=True)
    assert done.value.code in (0, None)
    out = capsys.readouterr().out
    assert "usage:" in out and "Ray Train" in out, out
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert any("parallelx.ray is deprecated" in m and "parallelx.launching.ray_train" in m for m in messages), messages
