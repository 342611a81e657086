"""Lazy re-export faces: Accelerate's module paths (``impel.utils``, ``impel.logging``, ...) name impel's objects.

A face is a table ``name -> "defining.module"`` (or ``"defining.module:other_name"``); a name is imported on first
access and cached on the face, so importing a face costs no more than ``import impel``.

Example::

    _EXPORTS = {"set_seed": "impel.runtime.seeding"}
    __all__ = sorted(_EXPORTS)
    __getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
"""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_face(module_name: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of a face module that re-exports ``exports``."""

    def __getattr__(name: str) -> Any:
        target = exports.get(name)
        if target is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        source, _, attr = target.partition(":")
        value = getattr(importlib.import_module(source), attr or name)
        setattr(sys.modules[module_name], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
