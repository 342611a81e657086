"""The members of Accelerate's ``DeepSpeedPlugin`` that public code reads, on impel's plugin.

Accelerate's plugin holds the DeepSpeed JSON as a dict (``deepspeed_config``) from its construction, fills its
"auto" values in place at ``prepare`` and knows whether it is the active one of several (``selected``). impel
settles the JSON when the Accelerator is built (:mod:`impel.config.deepspeed_json`), so:

- before an Accelerator settles the plugin, ``deepspeed_config`` is a read-only view of the JSON settled from the
  plugin alone (the launch config and the Accelerator's arguments can still change it);
- once an Accelerator settled it (:func:`attach`), ``deepspeed_config`` is a plain dict: the settled JSON, replaced
  by each engine's concrete JSON when ``prepare`` builds one under this plugin (Accelerate's ``auto`` values filled
  at prepare). A value the JSON left open (``"auto"`` or absent) written into it before ``prepare`` takes effect
  there, as in Accelerate; a change to a settled value raises at ``prepare``
  (:func:`impel.strategies.deepspeed_plugins.PluginConfigs.base_for`).

Example::

    plugin = DeepSpeedPlugin(hf_ds_config="zero3.json")
    acc = Accelerator(deepspeed_plugins={"student": plugin, "teacher": DeepSpeedPlugin(zero_stage=3)})
    plugin.selected, plugin.zero_stage, plugin.deepspeed_config["zero_optimization"]["stage"]   # True, 3, 3
"""
from __future__ import annotations

import copy
import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

from impel.config.deepspeed_json import _ABSENT, AUTO, get, put, settle_deepspeed
from impel.config.run_config import ConfigError, merge_code_arguments

if TYPE_CHECKING:
    from impel.config.deepspeed_json import Resolved


def _read_only(node: object) -> Any:
    if isinstance(node, Mapping):
        return types.MappingProxyType({k: _read_only(v) for k, v in node.items()})
    return node


class DeepSpeedPluginMembers:
    """Accelerate's ``DeepSpeedPlugin`` members (a mixin of :class:`impel.config.plugins.DeepSpeedPlugin`)."""

    _settled: dict[str, Any] | None = None  # the live JSON once an Accelerator settled the plugin
    _zero3_init: bool | None = None
    _selected: bool = False
    _selector: Callable[[], None] | None = None  # makes this plugin the active one (set by the DeepSpeed strategy)

    # --- the JSON -----------------------------------------------------------------------------------------------
    @property
    def deepspeed_config(self) -> Any:
        """The DeepSpeed JSON as a dict (see the module docstring for when it is settled and when it is filled)."""
        if self._settled is not None:
            return self._settled
        return _read_only(self._alone().ds)

    @deepspeed_config.setter
    def deepspeed_config(self, value: Mapping[str, object]) -> None:
        """Accelerate's plugin lets code replace its JSON (transformers' ``propagate_args_to_deepspeed`` does).
        Before an Accelerator settles the plugin, the dict becomes the plugin's JSON (``hf_ds_config``); after, it
        is read back at the next ``prepare`` as an edit of the settled JSON (open values taken, settled ones
        refused)."""
        if not isinstance(value, Mapping):
            raise ConfigError(f"DeepSpeedPlugin.deepspeed_config = {value!r}: give the DeepSpeed JSON as a dict")
        if self._settled is None:
            setattr(self, "hf_ds_config", dict(value))  # noqa: B010 (a field of the dataclass this mixes into)
        else:
            self._settled = value if isinstance(value, dict) else dict(value)

    def _alone(self) -> Resolved:
        """The JSON settled from this plugin alone (no launch config, no Accelerator arguments)."""
        code = self.code_arguments(None)  # type: ignore[attr-defined]
        resolved, _ = settle_deepspeed(merge_code_arguments(None, code), self)
        return resolved

    def get_value(self, ds_key_long: str, default: object = None) -> Any:
        """The value at a dotted key (``"zero_optimization.stage"``), ``default`` when absent."""
        value = get(self.deepspeed_config, ds_key_long)
        return default if value is _ABSENT else value

    def is_auto(self, ds_key_long: str) -> bool:
        return bool(self.get_value(ds_key_long) == AUTO)

    def _live(self, what: str) -> dict[str, object]:
        if self._settled is None:
            raise ConfigError(f"DeepSpeedPlugin.{what}: the DeepSpeed JSON is settled when the Accelerator is built; "
                              "create Accelerator(deepspeed_plugin=...) first, or give the value in the JSON "
                              "(hf_ds_config) or as a plugin argument")
        return self._settled

    def fill_match(self, ds_key_long: str, mismatches: list[str] | None = None, must_match: bool = True,
                   **kwargs: object) -> None:
        """Accelerate's: an ``"auto"`` value at ``ds_key_long`` takes ``kwargs[ds_key_long]`` (a missing one raises
        ValueError); with ``must_match``, a concrete value that differs is appended to ``mismatches``."""
        live = self._live("fill_match")
        value = get(live, ds_key_long)
        if value is _ABSENT:
            return
        if value == AUTO:
            if ds_key_long not in kwargs:
                raise ValueError(f"`{ds_key_long}` not found in kwargs. Please specify `{ds_key_long}` without "
                                 "`auto` (set to correct value) in the DeepSpeed config file or pass it in kwargs.")
            put(live, ds_key_long, kwargs[ds_key_long])
        elif must_match and value is not None and ds_key_long in kwargs and value != kwargs[ds_key_long]:
            (mismatches if mismatches is not None else []).append(
                f"- ds {ds_key_long}={value} vs arg {ds_key_long}={kwargs[ds_key_long]}")

    def deepspeed_config_process(self, prefix: str = "", mismatches: list[str] | None = None,
                                 config: Mapping[str, object] | None = None, must_match: bool = True,
                                 **kwargs: object) -> None:
        """Accelerate's: :meth:`fill_match` every key of the JSON; mismatches raise one ValueError naming them."""
        mismatches = [] if mismatches is None else mismatches
        for key, value in (self._live("deepspeed_config_process") if config is None else config).items():
            if isinstance(value, Mapping):
                self.deepspeed_config_process(f"{prefix}{key}.", mismatches, value, must_match, **kwargs)
            else:
                self.fill_match(f"{prefix}{key}", mismatches, must_match=must_match, **kwargs)
        if mismatches and prefix == "":
            raise ValueError("Please correct the following DeepSpeed config values that mismatch kwargs values:\n"
                             + "\n".join(mismatches) + "\nThe easiest method is to set these DeepSpeed config "
                             "values to 'auto'.")

    def set_mixed_precision(self, mixed_precision: str) -> None:
        """Accelerate's state calls it with the Accelerator's precision; impel settled it with the JSON, so this
        checks the two agree."""
        config = self.deepspeed_config
        have = next((n for n in ("fp16", "bf16") if get(config, f"{n}.enabled") is True), "no")
        if mixed_precision != have:
            raise ConfigError(f"DeepSpeedPlugin.set_mixed_precision({mixed_precision!r}): the plugin's JSON is settled "
                              f"to {have!r}; give the precision as Accelerator(mixed_precision=...) or in the JSON's "
                              "bf16/fp16 sections")

    # --- ZeRO-3 construction ------------------------------------------------------------------------------------
    def is_zero3_init_enabled(self) -> bool:
        """Whether models built under ``accelerator.init_context()`` (and transformers' ``from_pretrained``) are
        partitioned at construction (ZeRO-3 with ``zero3_init_flag``)."""
        if self._zero3_init is not None:
            return self._zero3_init
        resolved = self._alone()
        return resolved.zero3_init and resolved.stage == 3

    def zero3_init_context_manager(self, enable: bool = False) -> NoReturn:
        from impel.config.unsupported import NotProvidedError

        raise NotProvidedError(f"DeepSpeedPlugin.zero3_init_context_manager(enable={enable}): impel settles "
                               "zero3_init_flag once per plugin; build the model outside accelerator.init_context() "
                               "(or give the plugin zero3_init_flag=False) to construct it unpartitioned")

    # --- which plugin is active ---------------------------------------------------------------------------------
    @property
    def selected(self) -> bool:
        """Whether this is the active plugin: the one ``prepare`` builds engines with. The first plugin given to the
        Accelerator is; ``AcceleratorState().select_deepspeed_plugin(name)`` switches."""
        return self._selected

    @selected.setter
    def selected(self, value: bool) -> None:
        raise NotImplementedError("'enabled' can only be set through calling "
                                  "'AcceleratorState().select_deepspeed_plugin(key)'.")

    def select(self, _from_accelerator_state: bool = False) -> None:
        """Make this plugin the active one (as in Accelerate, only through
        ``AcceleratorState().select_deepspeed_plugin(name)``)."""
        if not _from_accelerator_state:
            raise ValueError("A `DeepSpeedPlugin` object must be enabled manually by calling "
                             "`AcceleratorState().select_deepspeed_plugin(plugin_key)`.")
        if self._selector is None:
            raise ConfigError("DeepSpeedPlugin.select(): no Accelerator runs this plugin; pass it to "
                              "Accelerator(deepspeed_plugins={name: plugin}) first")
        self._selector()

    def _unselect(self) -> None:
        self._selected = False


def attach(plugin: DeepSpeedPluginMembers, resolved: Resolved, selector: Callable[[], None] | None,
           selected: bool) -> None:
    """Called by the DeepSpeed strategy: the plugin now answers with the Accelerator's settled JSON (a copy), and
    the fields left unset take the settled values, as Accelerate's plugin fills them from its JSON."""
    plugin._settled = copy.deepcopy(resolved.ds)
    plugin._zero3_init = resolved.zero3_init and resolved.stage == 3
    plugin._selector = selector
    plugin._selected = selected
    settled = {"zero_stage": resolved.stage, "offload_optimizer_device": resolved.offload("optimizer"),
               "offload_param_device": resolved.offload("param"), "zero3_init_flag": plugin._zero3_init,
               "zero3_save_16bit_model": resolved.save_16bit}
    for name, value in settled.items():
        if getattr(plugin, name, None) is None:
            setattr(plugin, name, value)


def mark_selected(plugin: DeepSpeedPluginMembers, selected: bool) -> None:
    plugin._selected = selected


def publish(plugin: DeepSpeedPluginMembers, config: Mapping[str, object]) -> None:
    """Replace the plugin's live JSON, in place (a reference taken earlier sees the new values)."""
    live = plugin._settled
    if live is None:
        return
    live.clear()
    live.update(config)
