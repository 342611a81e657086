"""From ``TrainingArguments`` to ``Accelerator(...)`` arguments: precision, accumulation, checkpoints, FSDP, DeepSpeed.

``fsdp`` takes transformers' option strings (``"full_shard auto_wrap offload"``, a list of them, or True) and
``fsdp_config`` transformers' keys, with or without the ``fsdp_`` prefix (a dict or a JSON file); both become one
:class:`impel.FullyShardedDataParallelPlugin`. ``deepspeed`` (a JSON file or a dict) becomes
``DeepSpeedPlugin(hf_ds_config=...)`` with its ``"auto"`` values filled from the arguments. Nothing is dropped: an
unknown key, an option FSDP2 cannot honour or two settings that disagree raise a ConfigError.

Example::

    kwargs = accelerator_kwargs(TrainingArguments(output_dir="out", fsdp="shard_grad_op offload"))
    acc = Accelerator(**kwargs)
"""
from __future__ import annotations

import copy
import os
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Protocol

from impel.config.run_config import (
    SHARDING_STRATEGIES,
    ConfigError,
    FSDPConfig,
    bool_word,
    did_you_mean,
    plugin_keyword,
    reshards_after_forward,
)
from impel.config.yaml_file import read_json_object

if TYPE_CHECKING:
    from impel.config.plugins import FullyShardedDataParallelPlugin

SHARDING_OPTIONS = {name.lower(): name for name in SHARDING_STRATEGIES}  # "full_shard" -> "FULL_SHARD"
FSDP_OPTIONS = tuple(SHARDING_OPTIONS) + ("offload", "auto_wrap")


class DistributedArguments(Protocol):
    """The fields of :class:`impel.trainer.arguments.TrainingArguments` this module reads. A Protocol, not an import:
    ``TrainingArguments`` calls :func:`check_distributed_arguments` while it is built, so it imports this module."""

    output_dir: str | None
    logging_dir: str | None
    per_device_train_batch_size: int
    gradient_accumulation_steps: int | None
    max_grad_norm: float | None
    bf16: bool
    fp16: bool
    use_cpu: bool
    save_on_each_node: bool
    seed: int
    data_seed: int | None
    fsdp: Any
    fsdp_config: Any
    deepspeed: Any

    @property
    def mixed_precision(self) -> str | None: ...


def _value_kind(meta: Any) -> str:
    if meta["listed"]:
        return "names"
    if meta["kind"] == "str" and meta["choices"] is not None:
        return "upper"
    return meta["kind"]


def _fsdp_keys() -> dict[str, tuple[str, str]]:
    """transformers' ``fsdp_config`` key (without ``fsdp_``) -> (FullyShardedDataParallelPlugin keyword, value kind),
    from FSDPConfig: each field is taken by its name, its plugin keyword and the keywords in its ``also`` metadata;
    a key that is itself a plugin keyword goes to that keyword (``cpu_offload``), the others to the field's."""
    out: dict[str, tuple[str, str]] = {}
    for f in fields(FSDPConfig):
        keyword = plugin_keyword(f)
        if keyword is None:
            continue
        for key in (f.name, keyword, *f.metadata["also"]):
            out[key.removeprefix(FSDPConfig.PREFIX)] = (keyword if key == f.name else key, _value_kind(f.metadata))
    return out


_FSDP_KEYS = _fsdp_keys()
# keys transformers accepts that only mean something when "on"; impel runs them "off" and raises otherwise
_INERT_FSDP_KEYS = {"xla": "impel does not drive XLA", "xla_fsdp_v2": "impel does not drive XLA",
                    "xla_fsdp_grad_ckpt": "impel does not drive XLA", "xla_fsdp_settings": "impel does not drive XLA"}


# --- fsdp -------------------------------------------------------------------------------------------------------
def fsdp_options(fsdp: Any) -> list[str] | None:
    """The option words of ``TrainingArguments.fsdp``: None when FSDP is off, [] for ``True`` (on, everything
    from ``fsdp_config`` or the defaults: FULL_SHARD).

    Example::

        fsdp_options("full_shard auto_wrap")   # ['full_shard', 'auto_wrap']
    """
    if fsdp is None or fsdp is False or fsdp == "" or fsdp == []:
        return None
    if fsdp is True:
        return []
    items = fsdp.replace(",", " ").split() if isinstance(fsdp, str) else list(fsdp)
    words = [str(getattr(item, "value", item)).strip().lower() for item in items]
    for word in words:
        if word not in FSDP_OPTIONS:
            raise ConfigError(f"fsdp={fsdp!r}: {word!r} is not an FSDP option; use any of "
                              f"{', '.join(FSDP_OPTIONS)}{did_you_mean(word, FSDP_OPTIONS)}")
    strategies = [w for w in words if w in SHARDING_OPTIONS]
    if len(set(strategies)) > 1:
        raise ConfigError(f"fsdp={fsdp!r} names {len(set(strategies))} sharding strategies ({', '.join(strategies)});"
                          " keep one")
    return words


def load_json_knob(name: str, value: Any) -> dict[str, Any]:
    """A dict knob given as a dict or as the path of a JSON file holding one."""
    if isinstance(value, (str, os.PathLike)):
        return read_json_object(value, name)
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a dict or a JSON file holding an object, got {value!r}")
    return copy.deepcopy(value)


def _convert(key: str, raw: Any, kind: str) -> Any:
    if kind == "bool":
        if isinstance(raw, str) and bool_word(raw) is not None:
            return bool_word(raw)
        if not isinstance(raw, bool):
            raise ConfigError(f"fsdp_config {key}={raw!r} must be true or false")
        return raw
    if kind == "int":
        try:
            return int(raw) if not isinstance(raw, bool) and float(raw) == int(float(raw)) else _bad(key, raw)
        except (TypeError, ValueError):
            return _bad(key, raw)
    if kind == "names":
        return [raw] if isinstance(raw, str) else list(raw)
    return raw.upper() if isinstance(raw, str) else raw


def _bad(key: str, raw: Any) -> Any:
    raise ConfigError(f"fsdp_config {key}={raw!r} must be an integer")


def fsdp_plugin_fields(fsdp: Any, fsdp_config: Any) -> dict[str, Any] | None:
    """``FullyShardedDataParallelPlugin`` keyword arguments for these two knobs; None when FSDP is off."""
    words = fsdp_options(fsdp)
    if words is None:
        if fsdp_config:
            raise ConfigError("fsdp_config is set but fsdp is not; set fsdp=True (or e.g. 'full_shard auto_wrap') or "
                              "remove fsdp_config")
        return None
    config = load_json_knob("fsdp_config", fsdp_config) if fsdp_config is not None else {}
    out: dict[str, Any] = {}
    for raw_key, raw in config.items():
        key = raw_key.removeprefix("fsdp_")
        if key in _INERT_FSDP_KEYS:
            if raw not in (False, None, {}, "false", "False"):
                raise ConfigError(f"fsdp_config {raw_key}={raw!r}: {_INERT_FSDP_KEYS[key]}; remove it")
            continue
        if key == "limit_all_gathers":  # FSDP1's rate limiter; FSDP2 bounds in-flight all-gathers by itself
            if _convert(raw_key, raw, "bool") is False:
                raise ConfigError(f"fsdp_config {raw_key}=false has no FSDP2 equivalent (FSDP2 always limits "
                                  "in-flight all-gathers); remove it")
            continue
        if key not in _FSDP_KEYS:
            known = sorted(_FSDP_KEYS) + sorted(_INERT_FSDP_KEYS) + ["limit_all_gathers"]
            raise ConfigError(f"unknown fsdp_config key {raw_key!r}{did_you_mean(key, known)}")
        field_name, kind = _FSDP_KEYS[key]
        if key == "reshard_after_forward" and isinstance(raw, str) and raw.lower() in SHARDING_OPTIONS:
            field_name, kind = "sharding_strategy", "upper"  # an FSDP1-style value: a strategy name
        value = _convert(raw_key, raw, kind)
        if key == "min_num_params" and value == 0:
            continue  # transformers' default, meaning "not set"
        _put(out, field_name, value, f"fsdp_config {raw_key}")
    for word in words:
        if word in SHARDING_OPTIONS:
            _put(out, "sharding_strategy", SHARDING_OPTIONS[word], f"fsdp={fsdp!r}")
        elif word == "offload":
            _put(out, "cpu_offload", True, f"fsdp={fsdp!r}")
    if out.get("cpu_offload") is not None and out.get("offload_params") is not None:
        _put(out, "cpu_offload", out.pop("offload_params"), "fsdp_config offload_params")
    if out.get("sharding_strategy") is not None and out.get("reshard_after_forward") is not None:
        implied = reshards_after_forward(out["sharding_strategy"])
        if implied != out["reshard_after_forward"]:
            raise ConfigError(f"fsdp_config reshard_after_forward={out['reshard_after_forward']} contradicts the "
                              f"sharding strategy {out['sharding_strategy']}; set only one of them")
        del out["reshard_after_forward"]
    return out


def _put(out: dict[str, Any], name: str, value: Any, source: str) -> None:
    if out.get(name) is not None and out[name] != value:
        raise ConfigError(f"{source} sets {name}={value!r} but another setting already made it {out[name]!r}; "
                          "set it once")
    out[name] = value


def fsdp_plugin(args: DistributedArguments) -> FullyShardedDataParallelPlugin | None:
    """The plugin ``TrainingArguments.fsdp`` / ``fsdp_config`` describe, or None when FSDP is off."""
    fields = fsdp_plugin_fields(args.fsdp, args.fsdp_config)
    if fields is None:
        return None
    from impel.config.plugins import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(**fields)


# --- deepspeed --------------------------------------------------------------------------------------------------
def deepspeed_config(args: DistributedArguments) -> dict[str, Any] | None:
    """The DeepSpeed JSON with transformers' ``"auto"`` values filled from the arguments; None when off.

    Filled: ``train_micro_batch_size_per_gpu`` (per_device_train_batch_size), ``gradient_accumulation_steps`` (when
    set here), ``gradient_clipping`` (max_grad_norm), ``fp16.enabled`` / ``bf16.enabled``. ``train_batch_size``
    "auto" is left for the Accelerator, which knows the world size; the ``optimizer`` / ``scheduler`` sections'
    "auto" values are filled at ``prepare`` from the placeholders the Trainer passes (see
    :func:`deepspeed_sections`). An explicit value that disagrees raises.
    """
    if args.deepspeed is None or args.deepspeed is False:
        return None
    config = load_json_knob("deepspeed", args.deepspeed)
    _fill(config, "train_micro_batch_size_per_gpu", args.per_device_train_batch_size, "per_device_train_batch_size")
    if args.gradient_accumulation_steps is not None:
        _fill(config, "gradient_accumulation_steps", args.gradient_accumulation_steps, "gradient_accumulation_steps")
    if args.max_grad_norm:
        _fill(config, "gradient_clipping", float(args.max_grad_norm), "max_grad_norm")
    for mode in ("fp16", "bf16"):
        section = config.get(mode)
        if isinstance(section, dict) and "enabled" in section:
            wanted = getattr(args, mode)
            if section["enabled"] == "auto":
                section["enabled"] = wanted
            elif section["enabled"] and args.mixed_precision not in (None, mode):
                raise ConfigError(f"the deepspeed config enables {mode} but TrainingArguments sets "
                                  f"{args.mixed_precision}=True; set only one of them")
            elif not section["enabled"] and wanted:
                raise ConfigError(f"the deepspeed config has {mode}.enabled=false but TrainingArguments sets "
                                  f"{mode}=True; set only one of them")
    return config


def _fill(config: dict[str, Any], key: str, value: Any, arg: str) -> None:
    have = config.get(key)
    if have is None or have == "auto":
        if have == "auto" or key != "gradient_clipping":
            config[key] = value
        return
    if have != value:
        raise ConfigError(f"the deepspeed config says {key}={have!r} but TrainingArguments {arg}={value!r}; set "
                          f"{key} to \"auto\" in the JSON or make them equal")


def deepspeed_sections(args: DistributedArguments) -> set[str]:
    """Which of "optimizer" / "scheduler" the DeepSpeed JSON defines (the Trainer then passes DeepSpeed's
    placeholders, ``DummyOptim`` / ``DummyScheduler``, filled from learning_rate, adam_*, weight_decay, warmup)."""
    config = deepspeed_config(args) or {}
    return {section for section in ("optimizer", "scheduler") if section in config}


def deepspeed_plugin(args: DistributedArguments) -> Any:
    """``DeepSpeedPlugin(hf_ds_config=...)`` for ``TrainingArguments.deepspeed``, or None when it is not set."""
    config = deepspeed_config(args)
    if config is None:
        return None
    from impel.config.plugins import DeepSpeedPlugin

    return DeepSpeedPlugin(hf_ds_config=config)


# --- everything ---------------------------------------------------------------------------------------------------
def check_distributed_arguments(args: DistributedArguments) -> None:
    """Parse ``fsdp``, ``fsdp_config`` and ``deepspeed`` now so a mistake surfaces when the arguments are built."""
    fields = fsdp_plugin_fields(args.fsdp, args.fsdp_config)
    if fields is not None:
        from impel.config.plugins import FullyShardedDataParallelPlugin

        FullyShardedDataParallelPlugin(**fields)  # validates with the YAML key names in its messages
    if deepspeed_config(args) is not None and fields is not None:
        raise ConfigError("fsdp and deepspeed are both set; choose one strategy")


def accelerator_kwargs(args: DistributedArguments) -> dict[str, Any]:
    """Keyword arguments for :class:`impel.Accelerator`; knobs left at their defaults are passed as None."""
    from impel.config.plugins import DataLoaderConfiguration, ProjectConfiguration

    # no total_limit: the Trainer rotates by itself, keeping the best checkpoint as transformers does
    project = ProjectConfiguration(project_dir=args.output_dir, logging_dir=args.logging_dir,
                                   automatic_checkpoint_naming=True, save_on_each_node=args.save_on_each_node)
    kwargs: dict[str, Any] = {"mixed_precision": args.mixed_precision,
                              "gradient_accumulation_steps": args.gradient_accumulation_steps,
                              "cpu": args.use_cpu or None, "project_config": project,
                              # the Trainer sizes its schedule in optimizer steps, as transformers' Trainer does
                              "step_scheduler_per_process": False,
                              # epoch e's order from seed + e, as transformers' Trainer asks of Accelerate
                              "dataloader_config": DataLoaderConfiguration(use_seedable_sampler=True,
                                                                           data_seed=_data_seed(args))}
    plugin = fsdp_plugin(args)
    if plugin is not None:
        kwargs["fsdp_plugin"] = plugin
    ds = deepspeed_plugin(args)
    if ds is not None:
        kwargs["deepspeed_plugin"] = ds
    return kwargs


def _data_seed(args: DistributedArguments) -> int:
    """transformers' rule: the sampler follows ``data_seed`` when set, else ``seed``."""
    return args.seed if args.data_seed is None else args.data_seed
