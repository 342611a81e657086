"""Accelerate's ``KwargsHandler``: the base of the ``kwargs_handlers`` dataclasses.

Its own module, under :mod:`impel.config.plugins` (which defines most handlers and re-exports it) and
:mod:`impel.config.profiling` (``ProfileKwargs``), which ``plugins`` reads when it sorts the handlers a user passed.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any, ClassVar


class KwargsHandler:
    """Base of the ``kwargs_handlers`` objects: ``to_kwargs()`` returns only the fields changed from defaults."""

    __dataclass_fields__: ClassVar[dict[str, Any]]  # declared only: every handler is a dataclass

    def to_kwargs(self) -> dict[str, Any]:
        default = self.__class__()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}
