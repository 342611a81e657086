"""Accelerate's several DeepSpeed plugins: one settled JSON per plugin, and which one is active.

``Accelerator(deepspeed_plugins={"student": zero2, "teacher": zero3})`` settles each plugin's JSON at resolve
(:func:`impel.accelerator.resolve.resolve`); the first is active. ``prepare`` builds the next engine with the
active plugin's JSON and the engine keeps it: its ZeRO stage, clipping, 16-bit gathering on save and checkpoint
format. ``AcceleratorState().select_deepspeed_plugin("teacher")`` switches the active plugin; ``init_context()``
and transformers' ZeRO-3 detection (``is_deepspeed_zero3_enabled``) follow it, as under Accelerate.

Each plugin exposes its JSON as ``plugin.deepspeed_config`` (:mod:`impel.config.deepspeed_plugin_members`): the
settled JSON, replaced by the concrete one of each engine built under it. :meth:`PluginConfigs.base_for` reads back
what a user wrote there before ``prepare``: a value the JSON left open ("auto" or absent) takes effect, a change to
a settled one raises.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from impel.config.deepspeed_json import _ABSENT, AUTO, get, put
from impel.config.deepspeed_plugin_members import attach, mark_selected, publish
from impel.config.run_config import ConfigError

if TYPE_CHECKING:
    from impel.config.deepspeed_json import Resolved
    from impel.config.plugins import DeepSpeedPlugin
    from impel.runtime.step.run_record import RunRecord


def _flat(node: object, prefix: str = "") -> dict[str, object]:
    if isinstance(node, Mapping) and node:
        return {k: v for key, value in node.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: node}


class PluginConfigs:
    """The DeepSpeed plugins of a run (one, unnamed, or several by name) with their settled JSON."""

    def __init__(self, record: RunRecord, on_select: Callable[[], None]) -> None:
        if record.deepspeed is None:
            raise ConfigError("the DeepSpeed strategy needs the DeepSpeed config settled by resolve()")
        named = record.deepspeed_named or ((None, record.plugins.deepspeed, record.deepspeed),)
        self._entries: dict[str | None, tuple[DeepSpeedPlugin | None, Resolved]] = {
            name: (plugin, resolved) for name, plugin, resolved in named}
        self.active: str | None = named[0][0]
        self._published: dict[str | None, dict[str, object]] = {}
        self._on_select = on_select
        for index, (name, plugin, resolved) in enumerate(named):
            if plugin is not None:
                attach(plugin, resolved, functools.partial(self.select, name), selected=index == 0)
                self._published[name] = copy.deepcopy(resolved.ds)

    @property
    def resolved(self) -> Resolved:
        """The active plugin's settled JSON."""
        return self._entries[self.active][1]

    @property
    def plugin(self) -> DeepSpeedPlugin | None:
        return self._entries[self.active][0]

    def all_resolved(self) -> list[Resolved]:
        return [resolved for _, resolved in self._entries.values()]

    def select(self, name: str | None) -> None:
        if name not in self._entries:
            raise KeyError(f"no DeepSpeed plugin named {name!r}; the Accelerator has "
                           f"{', '.join(map(repr, self._entries))}")
        self.active = name
        for key, (plugin, _) in self._entries.items():
            if plugin is not None:
                mark_selected(plugin, key == name)
        self._on_select()

    def base_for(self) -> Resolved:
        """The active plugin's settled JSON with what the user wrote into ``plugin.deepspeed_config`` since it was
        last published: open values (``"auto"`` or absent in the settled JSON) are taken, changed settled ones
        raise."""
        plugin, resolved = self._entries[self.active]
        if plugin is None or self.active not in self._published:
            return resolved
        live, before = _flat(plugin.deepspeed_config), _flat(self._published[self.active])
        edits = {key: value for key, value in live.items() if before.get(key, _ABSENT) != value}
        removed = [key for key in before if key not in live]
        if not edits and not removed:
            return resolved
        ds = copy.deepcopy(resolved.ds)
        for key, value in edits.items():
            settled = get(ds, key)
            if settled is not _ABSENT and settled != AUTO and settled != value:
                raise ConfigError(self._refusal(key, value, settled))
            put(ds, key, value)
        if removed:
            raise ConfigError(self._refusal(removed[0], "<removed>", get(ds, removed[0])))
        return dataclasses.replace(resolved, ds=ds)

    def _refusal(self, key: str, value: object, settled: object) -> str:
        name = "" if self.active is None else f"[{self.active!r}]"
        return (f"deepspeed_plugin{name}.deepspeed_config[{key!r}] was set to {value!r} after the Accelerator settled "
                f"it to {settled!r} (stage, offload, clipping, precision and accumulation are fixed when the "
                "Accelerator is built); give the value in the plugin's JSON (hf_ds_config) or as a DeepSpeedPlugin "
                "argument. Values the JSON leaves \"auto\" (batch sizes, bucket sizes) may be set before prepare()")

    def publish(self, config: Mapping[str, object]) -> None:
        """The engine just built under the active plugin ran with ``config``: the plugin shows it."""
        plugin = self._entries[self.active][0]
        if plugin is not None:
            publish(plugin, copy.deepcopy(dict(config)))
            self._published[self.active] = copy.deepcopy(dict(config))
