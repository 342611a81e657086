"""Type names shared across the layers (layer 0: only the standard library).

An alias here names a shape that many modules trade, so that an annotation says what a value is instead of ``Any``.
None of them is ``Any`` under another name: each is checked by mypy like the type it spells out.

- ``JSON``: a value as ``json.load`` or a YAML loader returns it (a DeepSpeed config, a run record, a manifest).
- ``JSONDict``: a JSON object (the top level of such a file).
- ``Options``: keyword options read but never modified (what a user passed through to an engine).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TypeAlias

JSON: TypeAlias = None | bool | int | float | str | list["JSON"] | dict[str, "JSON"]
JSONDict: TypeAlias = dict[str, JSON]
Options: TypeAlias = Mapping[str, object]

__all__ = ["JSON", "JSONDict", "Options"]
