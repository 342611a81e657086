"""Values the FSDP plugin accepts in several spellings, normalised to the config's: torch's enums and FSDP1 / FSDP2
offload objects, class lists, and a mixed-precision policy turned into impel's ``mixed_precision`` mode."""
from __future__ import annotations

import enum
from typing import Any

from impel.config.run_config import ConfigError


def enum_name(value: object) -> object:
    return value.name if isinstance(value, enum.Enum) else value


def class_names(value: Any) -> str:
    items = value.split(",") if isinstance(value, str) else list(value)
    names = [item.__name__ if isinstance(item, type) else str(item).strip() for item in items]
    return ",".join(n for n in names if n)


def offload_flag(cpu_offload: object, offload_params: bool | None) -> bool | None:
    flag = cpu_offload
    if flag is not None and not isinstance(flag, bool):
        if hasattr(flag, "offload_params"):  # FSDP1's CPUOffload
            flag = bool(flag.offload_params)
        elif type(flag).__name__ in ("CPUOffloadPolicy", "OffloadPolicy"):  # FSDP2
            flag = type(flag).__name__ == "CPUOffloadPolicy"
        else:
            raise ConfigError(f"FullyShardedDataParallelPlugin(cpu_offload={cpu_offload!r}) must be True/False, "
                              "CPUOffload(offload_params=...) or CPUOffloadPolicy()")
    if flag is not None and offload_params is not None and flag != offload_params:
        raise ConfigError(f"FullyShardedDataParallelPlugin(cpu_offload={cpu_offload!r}, offload_params="
                          f"{offload_params!r}) disagree; they are the same switch, set one")
    return flag if flag is not None else offload_params


_MODE_OF_DTYPE = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16",
                  "float32": "no", "fp32": "no", "float": "no", "no": "no"}


def _dtype_name(value: object) -> str | None:
    if value is None:
        return None
    return str(value).replace("torch.", "").lower()


def mixed_precision_mode(policy: object) -> str | None:
    """The mixed_precision mode a plugin's ``mixed_precision_policy`` asks for; None when not given."""
    if policy is None:
        return None
    if isinstance(policy, str):
        mode = _MODE_OF_DTYPE.get(policy.lower())
        if mode is None:
            raise ConfigError(f"FullyShardedDataParallelPlugin(mixed_precision_policy={policy!r}) is unknown; use "
                              "'bf16', 'fp16' or 'no'")
        return mode
    get = policy.get if isinstance(policy, dict) else (lambda name: getattr(policy, name, None))
    param = _dtype_name(get("param_dtype"))
    mode = _MODE_OF_DTYPE.get(param or "no")
    if mode is None:
        raise ConfigError(f"mixed_precision_policy param_dtype={get('param_dtype')!r} is not supported; use "
                          "torch.bfloat16, torch.float16 or None")
    for name in ("reduce_dtype", "buffer_dtype", "output_dtype"):
        value = _dtype_name(get(name))
        if value is not None and value not in ("float32", "float"):
            raise ConfigError(f"mixed_precision_policy {name}={get(name)!r} is not supported: impel's FSDP keeps "
                              "buffers and outputs as computed and reduces gradients in float32; drop "
                              f"{name} or set it to torch.float32")
    return mode
