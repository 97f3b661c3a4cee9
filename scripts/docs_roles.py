"""A griffe extension for the API reference (mkdocs.yml loads it): the docstrings
name other objects with Sphinx roles (:func:`get_backend`, :meth:`Backend.batches`),
which Markdown would print as ":func:" before the name; this keeps the name alone,
as code."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|exc|obj):`~?([^`]+)`")


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(r"`\1`", obj.docstring.value)
