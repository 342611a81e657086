"""``option()``: a config field with its schema, shared by the sections of :mod:`impel.config` and
:mod:`impel.compile_config` (it imports nothing from impel, so both can use it).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field
from typing import Any


def option(default: Any, kind: str, help: str, *, choices: tuple | None = None, minimum: float | None = None,
           question: str | None = None, flag: str | None = None, aliases: Mapping[Any, Any] | None = None) -> Any:
    """A config field with its schema. ``kind`` is one of str, int, float, bool."""
    meta = {"kind": kind, "help": help, "choices": choices, "min": minimum, "question": question, "flag": flag,
            "aliases": dict(aliases or {})}
    return field(default=default, metadata=meta)
