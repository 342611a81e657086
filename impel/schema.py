"""``option()``: a config field with its schema, shared by the sections of :mod:`impel.config` and
:mod:`impel.compile_config` (it imports nothing from impel, so both can use it).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, field
from typing import Any


def option(default: Any, kind: str, help: str, *, choices: tuple | None = None, minimum: float | None = None,
           question: str | None = None, flag: str | None = None, aliases: Mapping[Any, Any] | None = None,
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
    meta = {"kind": kind, "help": help, "choices": choices, "min": minimum, "question": question, "flag": flag,
            "aliases": dict(aliases or {}), "plugin": plugin, "also": tuple(also), "listed": listed,
            "suggest": default if suggest is MISSING else suggest, "ask_if": ask_if, "deepspeed_note": deepspeed_note}
    return field(default=default, metadata=meta)
