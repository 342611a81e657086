"""Accelerate's ``ACCELERATE_*`` / ``FSDP_*`` environment variables (and their ``IMPEL_*`` names) as run settings.

Accelerate's Accelerator reads its settings from the environment that ``accelerate launch`` (or a torchrun, SLURM or
Kubernetes job) exports; impel reads the same variables here, into the run config's keys, with Accelerate's
precedence: **code argument > environment > config file**. Outside ``impel launch`` (plain ``python`` / ``torchrun``)
the environment is the launched config; ``impel launch`` folds it in between the config file and its flags
(file < environment < flags) and its ranks receive the result, so nothing is applied twice.

``IMPEL_<NAME>`` wins over ``ACCELERATE_<NAME>`` (``IMPEL_MIXED_PRECISION`` over ``ACCELERATE_MIXED_PRECISION``;
``IMPEL_FSDP_OFFLOAD_PARAMS`` over ``FSDP_OFFLOAD_PARAMS``). As in Accelerate, ``FSDP_*`` variables count only with
``ACCELERATE_USE_FSDP=true`` and ``ACCELERATE_DEEPSPEED_*`` ones only with ``ACCELERATE_USE_DEEPSPEED=true``. A
variable impel cannot honour (``ACCELERATE_USE_MEGATRON_LM=true``, ``ACCELERATE_FP8_BACKEND``, ...) raises naming it;
a value that is not valid raises naming the variable and its config key.

Example::

    # ACCELERATE_MIXED_PRECISION=bf16 ACCELERATE_GRADIENT_ACCUMULATION_STEPS=4 torchrun --nproc-per-node 2 train.py
    environment_settings()   # {'mixed_precision': 'bf16', 'gradient_accumulation_steps': 4}
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from impel.config import environment as env
from impel.config.run_config import FALSE_WORDS, SECTIONS, TRUE_WORDS, ConfigError, RunConfig, coerce

# Accelerate's variable -> the run config key it sets ("section.key" inside a section)
PLAIN = {
    "ACCELERATE_MIXED_PRECISION": "mixed_precision",
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "gradient_accumulation_steps",
    "ACCELERATE_USE_CPU": "use_cpu",
    "ACCELERATE_DEBUG_MODE": "debug",
    "ACCELERATE_DYNAMO_BACKEND": "dynamo_config.dynamo_backend",
    "ACCELERATE_DYNAMO_MODE": "dynamo_config.dynamo_mode",
    "ACCELERATE_DYNAMO_USE_FULLGRAPH": "dynamo_config.dynamo_use_fullgraph",
    "ACCELERATE_DYNAMO_USE_DYNAMIC": "dynamo_config.dynamo_use_dynamic",
    "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "dynamo_config.dynamo_use_regional_compilation",
}
FSDP = {f"FSDP_{name.upper()}": f"fsdp_config.fsdp_{name}" for name in (
    "version", "sharding_strategy", "reshard_after_forward", "offload_params", "auto_wrap_policy", "min_num_params",
    "backward_prefetch", "forward_prefetch", "state_dict_type", "use_orig_params", "sync_module_states",
    "cpu_ram_efficient_loading", "activation_checkpointing")}
FSDP["FSDP_TRANSFORMER_CLS_TO_WRAP"] = "fsdp_config.fsdp_transformer_layer_cls_to_wrap"
DEEPSPEED = {f"ACCELERATE_DEEPSPEED_{name.upper()}": f"deepspeed_config.{name}" for name in (
    "zero_stage", "offload_optimizer_device", "offload_param_device", "offload_optimizer_nvme_path",
    "offload_param_nvme_path", "zero3_save_16bit_model", "config_file")}
DEEPSPEED["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = "deepspeed_config.deepspeed_config_file"
DEEPSPEED["ACCELERATE_DEEPSPEED_ZERO3_INIT"] = "deepspeed_config.zero3_init_flag"
DEEPSPEED["ACCELERATE_GRADIENT_CLIPPING"] = "deepspeed_config.gradient_clipping"
STRATEGIES = {"ACCELERATE_USE_FSDP": ("FSDP", FSDP), "ACCELERATE_USE_DEEPSPEED": ("DEEPSPEED", DEEPSPEED)}
# values Accelerate's launcher writes for "not set"
_UNSET_WORDS = {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": ("auto",), "ACCELERATE_GRADIENT_CLIPPING": ("auto", "none"),
                **{name: ("none",) for name in DEEPSPEED if name.endswith(("_PATH", "_FILE", "_DEVICE"))}}

# variables impel cannot honour: set (to anything but an "off" word) they raise with the reason
UNSUPPORTED = {
    "ACCELERATE_USE_MEGATRON_LM": "selects Megatron-LM, which impel does not drive; use FSDP "
                                  "(ACCELERATE_USE_FSDP=true) with a ParallelismConfig for tensor parallelism",
    "ACCELERATE_USE_SAGEMAKER": "selects Amazon SageMaker's launcher, which impel does not drive; start the job "
                                "with impel launch or torchrun",
    "ACCELERATE_FP8_BACKEND": "selects fp8 training, which impel does not run; use bf16",
    "ACCELERATE_DOWNCAST_BF16": "is for TPUs (torch_xla), which impel does not drive",
    "ACCELERATE_CPU_AFFINITY": "asks for CPU affinity per GPU, which impel does not set; pin processes with "
                               "numactl or taskset",
    "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES": "marks DeepSpeed MoE leaf modules, which impel does not set; "
                                                "call deepspeed.utils.set_z3_leaf_modules on the model",
    "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "offloads checkpointed activations, which impel's FSDP2 does not do; "
                                             "use FSDP_ACTIVATION_CHECKPOINTING=true alone",
    "FSDP_IGNORED_MODULES": "is not supported yet: impel does not exclude modules from FSDP2 sharding",
}
_OFF_WORDS = ("", "0", "false", "no", "off", "n", "f", "none")


def impel_name(name: str) -> str:
    """The ``IMPEL_*`` name of an Accelerate variable (``ACCELERATE_MIXED_PRECISION`` -> ``IMPEL_MIXED_PRECISION``,
    ``FSDP_OFFLOAD_PARAMS`` -> ``IMPEL_FSDP_OFFLOAD_PARAMS``)."""
    return "IMPEL_" + name.removeprefix("ACCELERATE_")


def all_names() -> list[str]:
    """Every Accelerate variable impel reads or refuses, in a stable order."""
    return [*PLAIN, *STRATEGIES, *FSDP, *DEEPSPEED, *UNSUPPORTED]


def set_variables() -> dict[str, tuple[str, str]]:
    """Accelerate variable -> (the name that set it, its value) for every one set, ``IMPEL_*`` first."""
    names = all_names()
    accelerate = env.read_variables(names)
    own = env.read_variables([impel_name(n) for n in names])
    out: dict[str, tuple[str, str]] = {}
    for name in names:
        if impel_name(name) in own:
            out[name] = (impel_name(name), own[impel_name(name)].strip())
        elif name in accelerate:
            out[name] = (name, accelerate[name].strip())
    return out


def environment_settings() -> dict[str, object]:
    """The run config keys the environment sets (sections as nested mappings); ``{}`` when it sets none."""
    found = set_variables()
    _refuse_unsupported(found)
    chosen = [(kind, table) for var, (kind, table) in STRATEGIES.items() if _switch(found, var)]
    if len(chosen) > 1:
        raise ConfigError("both ACCELERATE_USE_FSDP and ACCELERATE_USE_DEEPSPEED are true; set only one of them")
    out: dict[str, object] = {}
    tables = [PLAIN, *(table for _, table in chosen)]
    if chosen:
        out["distributed_type"] = chosen[0][0]
    for table in tables:
        for var, key in table.items():
            if var in found and found[var][1].lower() not in _UNSET_WORDS.get(var, ()):
                _put(out, key, _value(found[var], key))
    return out


def launched_settings() -> dict[str, Any] | None:
    """What the run was launched with: ``impel launch``'s config (the environment already folded in), else the
    environment's settings (plain ``python`` / ``torchrun``), else None."""
    launched = env.read_launch_config()
    if launched is not None:
        return launched
    return environment_settings() or None


def describe() -> list[str]:
    """One line per variable set (``ACCELERATE_MIXED_PRECISION=bf16 -> mixed_precision``), for ``impel env``."""
    lines = []
    for name, (shown, value) in set_variables().items():
        key = {**PLAIN, **FSDP, **DEEPSPEED}.get(name)
        what = (f"-> {key}" if key else "-> distributed_type" if name in STRATEGIES
                else "(impel cannot honour it: raises)")
        lines.append(f"{shown}={value} {what}")
    return lines


def _flag(found: Mapping[str, tuple[str, str]], name: str) -> bool:
    return name in found and found[name][1].lower() not in _OFF_WORDS


def _switch(found: Mapping[str, tuple[str, str]], name: str) -> bool:
    """A variable that turns a strategy on or off: a word Accelerate's ``str_to_bool`` takes, else a ConfigError."""
    if name not in found or not found[name][1]:
        return False
    shown, value = found[name]
    if value.lower() not in TRUE_WORDS + FALSE_WORDS:
        raise ConfigError(f"environment variable {shown}={value!r} must be true or false (also 1/0, yes/no, on/off, "
                          "y/n, t/f); fix or unset the variable")
    return value.lower() in TRUE_WORDS


def _refuse_unsupported(found: Mapping[str, tuple[str, str]]) -> None:
    for name, reason in UNSUPPORTED.items():
        if _flag(found, name) and not (name == "ACCELERATE_FP8_BACKEND" and found[name][1].upper() == "NO"):
            shown, value = found[name]
            raise ConfigError(f"environment variable {shown}={value!r} {reason}; unset it to run on impel")


def _value(found: tuple[str, str], key: str) -> object:
    shown, raw = found
    section, _, name = key.rpartition(".")
    owner = SECTIONS[section] if section else RunConfig
    prefix = getattr(owner, "PREFIX", "")
    meta = next(f.metadata for f in fields(owner) if prefix + f.name == name)
    try:
        return coerce(name, raw, meta, from_text=True)
    except ConfigError as exc:
        raise ConfigError(f"environment variable {shown}={raw!r}: {exc}; fix or unset the variable") from None


def _put(out: dict[str, Any], key: str, value: Any) -> None:
    section, _, name = key.rpartition(".")
    (out.setdefault(section, {}) if section else out)[name] = value
