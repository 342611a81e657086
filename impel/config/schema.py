"""The config fields' schema: ``option()`` declares a field with its kind, choices and other names; ``coerce``
checks (and, for text from flags or prompts, converts) a value against it; ``ConfigError`` is the error every bad
value raises; ``Section`` is the shape of a config section. Shared by :mod:`impel.config.run_config` and
:mod:`impel.config.dynamo`; it imports nothing from impel and never imports torch.
"""
from __future__ import annotations

import difflib
import enum
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, Field, field, fields
from typing import Any, ClassVar, Protocol


class Section(Protocol):
    """A config section (``fsdp_config``, ``deepspeed_config``, ``dynamo_config``): a dataclass of :func:`option`
    fields whose YAML keys and flags are ``PREFIX`` + the field name."""

    PREFIX: str
    __dataclass_fields__: ClassVar[dict[str, Any]]

    def __init__(self, **values: Any) -> None: ...

    def validate(self) -> Any: ...


def option(default: Any, kind: str, help: str, *, choices: tuple | None = None, minimum: float | None = None,
           maximum: float | None = None, question: str | None = None, flag: str | None = None,
           aliases: Mapping[Any, Any] | None = None,
           plugin: str | bool | None = None, also: tuple[str, ...] = (), listed: bool = False,
           suggest: Any = MISSING, ask_if: tuple[str, Any] | None = None, deepspeed_note: str | None = None) -> Any:
    """A config field with its schema; every other spelling of the option is derived from it.

    ``kind`` is one of str, int, float, bool. ``aliases`` map other values onto allowed ones (FSDP1's ``1`` ->
    ``FULL_SHARD``). The names the option has elsewhere: ``flag`` (the launch flag, default the YAML key),
    ``plugin`` (the keyword of Accelerate's ``FullyShardedDataParallelPlugin`` / ``DeepSpeedPlugin``, default the
    field's name; False: the plugin has none generated), ``also`` (more keywords of the same option that the
    plugin writes by hand, e.g. ``cpu_offload``, which takes torch's objects too; the Trainer's ``fsdp_config``
    takes them as keys). ``listed``: comma-separated names, which code may pass as a list (of names or classes).
    For ``impel config``: ``question`` (asked when set), ``suggest`` (the default shown when it is not the
    field's), ``ask_if=(field, answer)`` (asked only after that answer). ``deepspeed_note``: why ``impel config
    convert --to deepspeed`` has no counterpart for this FSDP key.
    """
    meta = {"kind": kind, "help": help, "choices": choices, "min": minimum, "max": maximum, "question": question,
            "flag": flag, "aliases": dict(aliases or {}), "plugin": plugin, "also": tuple(also), "listed": listed,
            "suggest": default if suggest is MISSING else suggest, "ask_if": ask_if, "deepspeed_note": deepspeed_note}
    return field(default=default, metadata=meta)


class ConfigError(ValueError):
    """A config value is wrong; the message names the value and the fix."""


def did_you_mean(key: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


class Freezable:
    """A config object that becomes read-only once the run is resolved (:mod:`impel.accelerator.resolve`)."""

    _frozen = False

    def freeze(self) -> None:
        for value in vars(self).values():
            if isinstance(value, Freezable):
                value.freeze()
        object.__setattr__(self, "_frozen", True)

    def __setattr__(self, name: str, value: object) -> None:
        if self._frozen:
            raise AttributeError(f"{type(self).__name__}.{name} is read-only: the run config is settled when the "
                                 f"Accelerator is built; pass {name} to Accelerator(...) or set it in the launch "
                                 "config instead")
        object.__setattr__(self, name, value)


def plugin_keyword(f: Field) -> str | None:
    """The keyword of Accelerate's plugin generated for a section field, or None when the plugin has none."""
    name = f.metadata.get("plugin")
    return None if name is False else (name or f.name)


def plugin_keywords(cls: type) -> dict[str, str]:
    """Plugin keyword -> field name for every field of a section (``fsdp_version`` -> ``version``)."""
    return {kw: f.name for f in fields(cls) if (kw := plugin_keyword(f)) is not None}


# the words a bool takes as text (flags, prompts, the Trainer's fsdp_config values)
TRUE_WORDS = ("true", "yes", "1", "on", "y", "t")
FALSE_WORDS = ("false", "no", "0", "off", "n", "f", "none")


def bool_word(text: str) -> bool | None:
    """True / False for a word of :data:`TRUE_WORDS` / :data:`FALSE_WORDS` (any case), else None."""
    word = text.strip().lower()
    return True if word in TRUE_WORDS else False if word in FALSE_WORDS else None


def coerce(name: str, value: Any, meta: Mapping[str, Any], from_text: bool = False) -> object:
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
    too_big = meta.get("max") is not None and value > meta["max"]
    if (meta["min"] is not None and value < meta["min"]) or too_big:
        what = {"int": "an integer", "float": "a number"}.get(kind, "a value")
        raise ConfigError(f"{name}={value!r} must be {what}{_min_text(meta)}")
    return value


def _hashable(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _min_text(meta: Mapping[str, object]) -> str:
    if meta.get("max") is not None:
        return f" from {meta['min']:g} to {meta['max']:g}"
    return f" >= {meta['min']:g}" if meta["min"] is not None else ""


def _parse_text(name: str, raw: str, kind: str, choices: tuple | None) -> object:
    text = raw.strip()
    if choices is not None and any(isinstance(c, int) and not isinstance(c, bool) for c in choices):
        kind = "int"
    try:
        if kind == "bool":
            flag = bool_word(text)
            if flag is None:
                raise ValueError
            return flag
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
    except ValueError:
        expected = {"bool": "true or false", "int": "an integer", "float": "a number"}[kind]
        raise ConfigError(f"{name}={raw!r} must be {expected}") from None
    return text


def validate_fields(obj: Any) -> None:
    """Check and normalise every schema field of a config dataclass (names carry the section's PREFIX)."""
    prefix = getattr(obj, "PREFIX", "")
    for f in fields(obj):
        if "kind" in f.metadata:
            setattr(obj, f.name, coerce(prefix + f.name, getattr(obj, f.name), f.metadata))
