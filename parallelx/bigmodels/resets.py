"""Which ``reset_parameters`` an eager build ran: read from the constructors' source.

A plain ``torch.device("meta")`` build keeps no trace of its ``__init__``, so the values an eager
build made are recomputed from the modules' resets (:func:`parallelx.bigmodels.meta.record_reset`).
That is the eager build only when it replays the resets eager construction ran: every layer of
``torch.nn`` calls its own in ``__init__``, but a composite ``reset_parameters`` that re-runs its
children's (PyTorch's FSDP2 example) may be called by nobody at construction, only after
``to_empty``; replayed on top of its children's, it re-draws their tensors.
:func:`constructor_runs` tells which, from the source of ``__init__`` and of the methods it calls
on ``self`` (``super().__init__`` included).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import weakref
from typing import Any

from torch import nn

__all__ = ["constructor_runs", "reset_name"]


def reset_name(module: nn.Module) -> str | None:
    """The name of the reset a module's values come from: ``reset_parameters``, or torch's private
    ``_reset_parameters`` where a module has only that (``nn.MultiheadAttention``)."""
    for name in ("reset_parameters", "_reset_parameters"):
        if callable(getattr(module, name, None)):
            return name
    return None


#: Class -> reset name -> :func:`constructor_runs`' answer (classes made at run time may go).
_known: weakref.WeakKeyDictionary[type, dict[str, bool | None]] = weakref.WeakKeyDictionary()


def constructor_runs(cls: type, name: str) -> bool | None:
    """Whether constructing ``cls`` calls ``self.<name>()``: True where its ``__init__`` (or a method
    it calls on ``self``, or a base's ``__init__`` it reaches) does; False where none of that code
    does or names it; None where some of it cannot be read (no source: a class made by ``exec``)
    or names it otherwise (``self.apply(lambda m: m.reset_parameters())``)."""
    answers = _known.setdefault(cls, {})
    if name not in answers:
        owner = _owner(cls, "__init__")
        answers[name] = _Reader(cls, name).runs(vars(owner)["__init__"] if owner else None, owner)
    return answers[name]


def _owner(cls: type, attr: str, after: type | None = None) -> type | None:
    """The class of ``cls``'s method order (after ``after``) that defines ``attr``."""
    mro = cls.__mro__
    start = mro.index(after) + 1 if after is not None and after in mro else 0
    return next((k for k in mro[start:] if attr in vars(k)), None)


class _Reader:
    def __init__(self, cls: type, name: str) -> None:
        self.cls, self.name = cls, name
        self.seen: set[Any] = set()

    def runs(self, func: Any, owner: type | None) -> bool | None:
        # nn.Module's own machinery (register_buffer, apply, ...) never calls a reset by itself.
        if owner is None or owner in (nn.Module, object) or func in self.seen:
            return False
        self.seen.add(func)
        func = inspect.unwrap(func)
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
        except (OSError, TypeError, SyntaxError):
            return None
        definition = tree.body[0]
        if not isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef)) or not definition.args.args:
            return None
        me = definition.args.args[0].arg
        globals_ = getattr(func, "__globals__", {})
        answers: list[bool | None] = []
        resolved: set[int] = set()
        for node in ast.walk(definition):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                answer = self._call(node, me, owner, globals_)
                if answer is not _UNRESOLVED:
                    answers.append(answer)
                    resolved.add(id(node.func))
        if True in answers:
            return True
        named = any(
            (isinstance(n, ast.Attribute) and n.attr == self.name and id(n) not in resolved)
            or (isinstance(n, ast.Name) and n.id == self.name)
            or (isinstance(n, ast.Constant) and n.value == self.name)
            for n in ast.walk(definition)
        )
        return None if named or None in answers else False

    def _call(self, node: ast.Call, me: str, owner: type, globals_: dict[str, Any]) -> Any:
        """What one call ``x.attr(...)`` says: True (the reset), a nested answer, or _UNRESOLVED."""
        assert isinstance(node.func, ast.Attribute)
        attr, target = node.func.attr, node.func.value
        if isinstance(target, ast.Name) and target.id == me:  # self.attr(...)
            if attr == self.name:
                return True
            return self._method(attr, _owner(self.cls, attr))
        if isinstance(target, ast.Call) and isinstance(target.func, ast.Name) and target.func.id == "super":
            if attr == self.name:
                return None  # a base's reset, not the one a replay runs
            return self._method(attr, _owner(self.cls, attr, after=owner))
        first = node.args[0] if node.args else None
        if isinstance(first, ast.Name) and first.id == me:  # Base.__init__(self, ...), type(self).reset(self)
            if attr == self.name:
                return True
            base = globals_.get(target.id) if isinstance(target, ast.Name) else None
            if isinstance(base, type) and issubclass(self.cls, base):
                return self._method(attr, _owner(self.cls, attr, after=_before(self.cls, base)))
        return _UNRESOLVED

    def _method(self, attr: str, owner: type | None) -> Any:
        func = vars(owner).get(attr) if owner is not None else None
        if not inspect.isfunction(func):
            return _UNRESOLVED  # a property, a child module, a builtin: not code of this class
        return self.runs(func, owner)


def _before(cls: type, base: type) -> type | None:
    """The class just before ``base`` in ``cls``'s method order (so that the search starts at ``base``)."""
    mro = cls.__mro__
    i = mro.index(base)
    return mro[i - 1] if i > 0 else None


#: What a call says when it is neither the reset nor code this class defines (a marker no answer equals).
_UNRESOLVED: Any = object()
