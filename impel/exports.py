"""Lazy re-export faces: Accelerate's module paths (``impel.utils``, ``impel.logging``, ...) name impel's objects.

A face is a table ``name -> "defining.module"`` (or ``"defining.module:other_name"``); a name is imported on first
access and cached on the face, so importing a face costs no more than ``import impel``.

Example::

    _EXPORTS = {"set_seed": "impel.runtime.loaders.seeding"}
    __all__ = sorted(_EXPORTS)
    __getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
"""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_face(module_name: str, exports: Mapping[str, str],
              listed: tuple[str, ...] = ()) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of a face module that re-exports ``exports`` (``listed``: its own names
    ``dir()`` shows too, e.g. ``__version__``). The one lazy-export implementation of the package."""

    def __getattr__(name: str) -> Any:
        target = exports.get(name)
        if target is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        source, _, attr = target.partition(":")
        if not source.startswith("impel"):  # relative to the face (a package): "hf" in impel.trainer
            source = f"{module_name}.{source}"
        value = getattr(importlib.import_module(source), attr or name)
        setattr(sys.modules[module_name], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted([*exports, *listed])

    return __getattr__, __dir__
