"""The schema under the config dataclasses: one field's declaration (:func:`option`), its check
(:func:`coerce`) and the error every bad value raises (:class:`ConfigError`).

:mod:`impel.config` (the run config) and :mod:`impel.compile_config` (its ``dynamo_config`` section) both build
on it; it imports nothing from impel and never imports torch.
"""
from __future__ import annotations

import difflib
import enum
from collections.abc import Iterable, Mapping
from dataclasses import field, fields
from typing import Any, ClassVar, Protocol


class Section(Protocol):
    """A config section (``fsdp_config``, ``deepspeed_config``, ``dynamo_config``): a dataclass of :func:`option`
    fields whose YAML keys and flags are ``PREFIX`` + the field name."""

    PREFIX: str
    __dataclass_fields__: ClassVar[dict[str, Any]]

    def __init__(self, **values: Any) -> None: ...

    def validate(self) -> Any: ...


class ConfigError(ValueError):
    """A config value is wrong; the message names the value and the fix."""


def did_you_mean(key: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def option(default: Any, kind: str, help: str, *, choices: tuple | None = None, minimum: float | None = None,
           question: str | None = None, flag: str | None = None, aliases: Mapping[Any, Any] | None = None) -> Any:
    """A config field with its schema. ``kind`` is one of str, int, float, bool."""
    meta = {"kind": kind, "help": help, "choices": choices, "min": minimum, "question": question, "flag": flag,
            "aliases": dict(aliases or {})}
    return field(default=default, metadata=meta)


_TRUE = ("true", "yes", "1", "on", "y")
_FALSE = ("false", "no", "0", "off", "n", "none")


def coerce(name: str, value: Any, meta: Mapping[str, Any], from_text: bool = False) -> Any:
    """Check (and, for text from flags or prompts, convert) one value against its field schema."""
    if value is None:
        return None
    if isinstance(value, enum.Enum):  # PrecisionType.BF16, DistributedType.FSDP: their plain values
        value = value.value
    value = meta["aliases"].get(value, value) if _hashable(value) else value
    kind, choices = meta["kind"], meta["choices"]
    if from_text and isinstance(value, str):
        value = _parse_text(name, value, kind, choices)
    if choices is not None:
        if value is False and ("no" in choices or "none" in choices):  # YAML 1.1 reads an unquoted `no` as false
            value = "no" if "no" in choices else "none"
        if isinstance(value, str):
            value = next((c for c in choices if isinstance(c, str) and c.lower() == value.lower()), value)
        if value not in choices or isinstance(value, bool) != any(isinstance(c, bool) for c in choices):
            allowed = ", ".join(repr(c) for c in choices)
            raise ConfigError(f"{name}={value!r} is not allowed; use one of {allowed}")
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{name}={value!r} must be true or false")
    elif kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name}={value!r} must be an integer" + _min_text(meta))
    elif kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name}={value!r} must be a number" + _min_text(meta))
        value = float(value)
    elif kind == "str" and not isinstance(value, str):
        raise ConfigError(f"{name}={value!r} must be a string")
    if meta["min"] is not None and value < meta["min"]:
        what = {"int": "an integer", "float": "a number"}.get(kind, "a value")
        raise ConfigError(f"{name}={value!r} must be {what}{_min_text(meta)}")
    return value


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _min_text(meta: Mapping[str, Any]) -> str:
    return f" >= {meta['min']:g}" if meta["min"] is not None else ""


def _parse_text(name: str, raw: str, kind: str, choices: tuple | None) -> Any:
    text = raw.strip()
    if choices is not None and any(isinstance(c, int) and not isinstance(c, bool) for c in choices):
        kind = "int"
    try:
        if kind == "bool":
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
    except ValueError:
        expected = {"bool": "true or false", "int": "an integer", "float": "a number"}[kind]
        raise ConfigError(f"{name}={raw!r} must be {expected}") from None
    return text


def validate_fields(obj: Any) -> None:
    """Check and coerce every schema field of a config dataclass (YAML key: ``PREFIX`` + field name)."""
    prefix = getattr(obj, "PREFIX", "")
    for f in fields(obj):
        if "kind" in f.metadata:
            setattr(obj, f.name, coerce(prefix + f.name, getattr(obj, f.name), f.metadata))
