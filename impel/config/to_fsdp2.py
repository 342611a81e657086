"""``impel to-fsdp2``: rewrite an Accelerate FSDP1 config file (``fsdp_version: 1`` or none) for FSDP2, key for key
as ``accelerate to-fsdp2`` does, then check that impel reads the result.

| FSDP1 key | FSDP2 file |
|---|---|
| fsdp_sharding_strategy | fsdp_reshard_after_forward (FULL_SHARD / HYBRID_SHARD: true, the others: false) |
| fsdp_backward_prefetch, fsdp_sync_module_states, fsdp_use_orig_params | dropped (FSDP2 decides) |
| fsdp_forward_prefetch | dropped (Accelerate's FSDP2 has no such option) |
| every other key | kept |
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from impel.config.run_config import RESHARD_AFTER_FORWARD, SHARDING_STRATEGIES, ConfigError, RunConfig

# FSDP1 key -> why accelerate to-fsdp2 drops it
_DROPPED = {
    "fsdp_backward_prefetch": "FSDP2 prefetches the next unit's parameters in backward itself",
    "fsdp_sync_module_states": "FSDP2 broadcasts rank 0's weights when fsdp_cpu_ram_efficient_loading is on",
    "fsdp_use_orig_params": "FSDP2 always trains the original parameters",
    "fsdp_forward_prefetch": "Accelerate's FSDP2 plugin has no forward prefetch",
}
_STRATEGY_KEYS = ("fsdp_sharding_strategy", "fsdp_reshard_after_forward")


def to_fsdp2(config: Mapping[str, Any]) -> tuple[dict[str, object], list[str]]:
    """The FSDP2 file and a note per change; a file without an FSDP section or already FSDP2 comes back as it is."""
    section = config.get("fsdp_config") or {}
    if not section:
        return dict(config), ["no fsdp_config in the file: nothing to convert"]
    if section.get("fsdp_version", 1) == 2:
        return dict(config), ["the file already says fsdp_version: 2: nothing to convert (set fsdp_version: 1 and "
                              "rerun if it still uses FSDP1's key names)"]
    notes: list[str] = []
    out: dict[str, Any] = {}
    for key, value in section.items():
        if key in _DROPPED:
            notes.append(f"{key}={value!r} dropped: {_DROPPED[key]}")
        elif key in _STRATEGY_KEYS:
            out["fsdp_reshard_after_forward"] = _reshards(key, value, notes)
        else:
            out[key] = value
    out["fsdp_version"] = 2
    converted = {**config, "fsdp_config": out}
    _check_impel_reads(converted)
    return converted, notes


def _reshards(key: str, value: Any, notes: list[str]) -> object:
    """FSDP1's sharding strategy (a name, or its number in torch's ShardingStrategy) as FSDP2's bool."""
    if isinstance(value, bool):
        return value
    name = SHARDING_STRATEGIES[int(value) - 1] if str(value) in {str(n) for n in range(1, 6)} else value
    if name == "NO_SHARD":
        notes.append(f"{key}=NO_SHARD -> fsdp_reshard_after_forward=false, as accelerate to-fsdp2 writes it: FSDP2 "
                     "then shards like SHARD_GRAD_OP (use DDP for no sharding at all)")
        return False
    if name not in RESHARD_AFTER_FORWARD:
        raise ConfigError(f"{key}={value!r} is not an FSDP sharding strategy; use one of "
                          f"{', '.join(SHARDING_STRATEGIES)} and rerun impel to-fsdp2")
    notes.append(f"{key}={name} -> fsdp_reshard_after_forward={str(RESHARD_AFTER_FORWARD[name]).lower()}")
    return RESHARD_AFTER_FORWARD[name]


def _check_impel_reads(converted: Mapping[str, object]) -> None:
    from impel.config.yaml_file import normalise_accelerate_keys

    try:
        RunConfig.from_dict(normalise_accelerate_keys(converted, "the converted file"))
    except ConfigError as exc:
        raise ConfigError(f"the converted file would not load in impel launch ({exc}); fix the input file and "
                          "rerun impel to-fsdp2") from None
