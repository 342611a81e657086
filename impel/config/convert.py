"""Translate a config between FSDP and DeepSpeed along the seed's table, with a note for every setting that has
no counterpart or changes the precision behaviour (``impel config convert``).

| FSDP | DeepSpeed |
|---|---|
| FULL_SHARD / HYBRID_SHARD | zero_stage 3 |
| SHARD_GRAD_OP / HYBRID_SHARD_ZERO2 | zero_stage 2 (ZeRO-1 maps back to SHARD_GRAD_OP) |
| NO_SHARD | zero_stage 0 |
| fsdp_offload_params (all or nothing) | offload_param_device + offload_optimizer_device: cpu |
| fsdp_cpu_ram_efficient_loading | zero3_init_flag |
| FULL_STATE_DICT | zero3_save_16bit_model |
| prefetch, wrapping, use_orig_params | transparent (DeepSpeed decides) |
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from impel.config.run_config import ConfigError, FSDPConfig, RunConfig, reshards_after_forward

_TO_SHARDING = {3: "FULL_SHARD", 2: "SHARD_GRAD_OP", 1: "SHARD_GRAD_OP", 0: "NO_SHARD"}
# FSDP keys with no DeepSpeed counterpart, and why (each field's deepspeed_note)
_TRANSPARENT = {FSDPConfig.PREFIX + f.name: f.metadata["deepspeed_note"] for f in fields(FSDPConfig)
                if f.metadata["deepspeed_note"]}
_PRECISION_NOTE = {
    "DEEPSPEED": "precision behaviour changes: with mixed_precision 'no', FSDP trains a 16-bit-loaded model in its "
                 "load dtype, while DeepSpeed upcasts to fp32 master weights and steps in fp32 (more memory)",
    "FSDP": "precision behaviour changes: FSDP keeps the model's load dtype when mixed_precision is 'no' (a bf16 "
            "model then trains with bf16 weights and optimizer states), where DeepSpeed kept fp32 master weights; "
            "set mixed_precision: bf16 to keep fp32 master weights under FSDP",
}


def convert(explicit: Mapping[str, object], target: str) -> tuple[dict[str, object], list[str]]:
    """Return the translated explicit config and the notes; ``target`` is 'deepspeed' or 'fsdp'."""
    target = target.lower()
    if target not in ("deepspeed", "fsdp"):
        raise ConfigError(f"--to {target!r} is not a strategy impel translates to; use 'deepspeed' or 'fsdp'")
    notes: list[str] = []
    explicit = readable(explicit, notes)
    source = RunConfig.from_dict(explicit)
    want = "DEEPSPEED" if target == "deepspeed" else "FSDP"
    if source.distributed_type == want:
        return dict(explicit), [*notes, f"the config already uses {want}; nothing to translate"]
    if source.distributed_type not in ("FSDP", "DEEPSPEED"):
        raise ConfigError(f"distributed_type={source.distributed_type!r}: only FSDP and DEEPSPEED configs translate; "
                          "set distributed_type to FSDP or DEEPSPEED first")
    base = {k: v for k, v in explicit.items() if k not in ("fsdp_config", "deepspeed_config")}
    base["distributed_type"] = want
    if want == "DEEPSPEED" and base.pop("parallelism_config", None):
        notes.append("parallelism_config: impel runs no tensor / context parallelism or HSDP mesh under DeepSpeed; the "
                     "section is dropped and ZeRO partitions over every rank (keep FSDP for N-D parallelism)")
    section = _fsdp_to_deepspeed(source, explicit.get("fsdp_config") or {}, notes) if want == "DEEPSPEED" \
        else _deepspeed_to_fsdp(source, base, notes)
    base["deepspeed_config" if want == "DEEPSPEED" else "fsdp_config"] = section
    if source.mixed_precision == "no" and base.get("mixed_precision", "no") == "no":
        notes.append(_PRECISION_NOTE[want])  # with 16-bit mixed precision both keep fp32 master weights
    RunConfig.from_dict(base)  # the translation is itself a valid config
    return base, notes


def readable(explicit: Mapping[str, Any], notes: list[str]) -> dict[str, Any]:
    """The config as impel reads it: an Accelerate FSDP1 file (``fsdp_version: 1``) names its options as FSDP1 did,
    which impel reads as FSDP2's, so the version key is dropped with a note (``impel launch`` refuses it)."""
    section = explicit.get("fsdp_config") or {}
    if str(section.get("fsdp_version", 2)) == "1":
        notes.append("fsdp_version=1 (FSDP1) read as FSDP2: its options carry over; impel to-fsdp2 rewrites the "
                     "file for FSDP2")
        explicit = {**explicit, "fsdp_config": {k: v for k, v in section.items() if k != "fsdp_version"}}
    return RunConfig.from_dict(explicit).to_dict(explicit_only=True)


def _zero_stage(strategy: str) -> int:
    """ZeRO-3 shards parameters outside forward/backward as FSDP does when it reshards after forward; ZeRO-2
    shards gradients and optimizer states only; NO_SHARD shards nothing."""
    return 0 if strategy == "NO_SHARD" else 3 if reshards_after_forward(strategy) else 2


def _fsdp_to_deepspeed(cfg: RunConfig, given: Mapping[str, object], notes: list[str]) -> dict[str, object]:
    fsdp = cfg.fsdp
    strategy = fsdp.resolved_sharding_strategy
    stage = _zero_stage(strategy)
    out: dict[str, object] = {"zero_stage": stage}
    notes.append(f"fsdp_sharding_strategy={strategy} -> zero_stage={stage}")
    if strategy.startswith("HYBRID"):
        notes.append(f"fsdp_sharding_strategy={strategy} (replicate across nodes, shard within) has no launch-config "
                     f"counterpart: ZeRO-{stage} shards over all ranks; DeepSpeed's hpZ (zero_hpz_partition_size in a "
                     "DeepSpeed JSON) is the closest")
    if fsdp.offload_params and stage == 0:
        notes.append("fsdp_offload_params has no ZeRO-0 counterpart (DeepSpeed offloads from ZeRO-1 up): nothing is "
                     "offloaded; choose SHARD_GRAD_OP or FULL_SHARD to offload")
    elif fsdp.offload_params:
        out["offload_optimizer_device"] = "cpu"
        if stage == 3:
            out["offload_param_device"] = "cpu"
        else:
            notes.append(f"fsdp_offload_params offloads parameters too, but ZeRO-{stage} can offload only the "
                         "optimizer: parameters stay on the GPU")
    if fsdp.cpu_ram_efficient_loading:
        if stage == 3:
            out["zero3_init_flag"] = True
        else:  # zero3_init_flag needs ZeRO-3: writing it would give a file impel rejects
            notes.append(f"fsdp_cpu_ram_efficient_loading has no ZeRO-{stage} counterpart (zero3_init_flag acts "
                         "only under ZeRO-3): every rank loads the whole model")
    full = fsdp.state_dict_type == "FULL_STATE_DICT"
    if stage == 3:
        out["zero3_save_16bit_model"] = full
        if full:
            notes.append("FULL_STATE_DICT -> zero3_save_16bit_model: the consolidated weights are saved in 16 bits "
                         "(FSDP saves them in the parameter dtype, fp32 with mixed precision)")
    elif full:  # zero3_save_16bit_model needs ZeRO-3: writing it would give a file impel rejects
        notes.append(f"fsdp_state_dict_type=FULL_STATE_DICT has no ZeRO-{stage} counterpart: every rank holds the "
                     "whole model, save_model writes full weights with nothing to set")
    for key in sorted(given):
        if key in _TRANSPARENT:
            notes.append(f"{key}: {_TRANSPARENT[key]}")
    notes.append("gradient clipping: FSDP clips in the loop (accelerator.clip_grad_norm_); set gradient_clipping in "
                 "deepspeed_config if the loop clips, DeepSpeed then clips inside its step")
    return out


def _deepspeed_to_fsdp(cfg: RunConfig, base: dict[str, object], notes: list[str]) -> dict[str, object]:
    ds = _effective_deepspeed(cfg, base, notes)
    _runner_to_fsdp(ds, base, notes)
    stage = ds.get("zero_stage", 2)
    out: dict[str, object] = {"fsdp_sharding_strategy": _TO_SHARDING[stage]}
    notes.append(f"zero_stage={stage} -> fsdp_sharding_strategy={_TO_SHARDING[stage]}")
    if stage == 1:
        notes.append("ZeRO-1 shards only optimizer states; FSDP has no such mode: SHARD_GRAD_OP also shards gradients")
    devices = {ds.get("offload_optimizer_device") or "none", ds.get("offload_param_device") or "none"}
    if devices != {"none"}:
        out["fsdp_offload_params"] = True
        notes.append("FSDP offload is all or nothing: parameters, gradients and optimizer states all move to the CPU "
                     f"(DeepSpeed offloaded optimizer={ds.get('offload_optimizer_device') or 'none'}, "
                     f"params={ds.get('offload_param_device') or 'none'})")
        if "nvme" in devices:
            notes.append("NVMe offload has no FSDP counterpart: FSDP offloads to CPU RAM instead")
    if ds.get("zero3_init_flag"):
        out["fsdp_cpu_ram_efficient_loading"] = True
        out["fsdp_sync_module_states"] = True
    if ds.get("zero3_save_16bit_model") is not None:
        full = bool(ds["zero3_save_16bit_model"])
        out["fsdp_state_dict_type"] = "FULL_STATE_DICT" if full else "SHARDED_STATE_DICT"
        if full:
            notes.append("zero3_save_16bit_model -> FULL_STATE_DICT: FSDP saves full weights in the parameter dtype, "
                         "not necessarily 16 bits")
    if ds.get("gradient_clipping"):
        notes.append(f"gradient_clipping={ds['gradient_clipping']} has no FSDP config key: call "
                     f"accelerator.clip_grad_norm_(model.parameters(), {ds['gradient_clipping']}) in the loop")
    notes.append("wrapping and prefetch were transparent in DeepSpeed; FSDP detects transformer layers from the model "
                 "(set fsdp_transformer_layer_cls_to_wrap to choose) and prefetches BACKWARD_PRE by default")
    return out


def _runner_to_fsdp(ds: dict[str, Any], base: dict[str, Any], notes: list[str]) -> None:
    """DeepSpeed's runner (a hostfile, its filters, a launcher) has no FSDP counterpart: impel launch is then started
    on every machine, rank 0 on the hostfile's first host."""
    given = [key for key in ("deepspeed_hostfile", "deepspeed_inclusion_filter", "deepspeed_exclusion_filter",
                             "deepspeed_multinode_launcher") if ds.get(key) not in (None, "standard")]
    if not given:
        return
    notes.append(f"{', '.join(given)}: DeepSpeed's runner starts only DeepSpeed jobs; under FSDP start impel launch "
                 "on every machine (--machine_rank R), or the ranks with mpirun (--mpirun_hostfile)")
    hostfile = ds.get("deepspeed_hostfile")
    if hostfile and base.get("num_machines", 1) > 1 and not base.get("main_process_ip"):
        from impel.config.hostfile import hostfile_lines

        first = hostfile_lines(hostfile, "deepspeed_hostfile")[0].host
        base["main_process_ip"] = first
        notes.append(f"main_process_ip={first!r}: the deepspeed_hostfile's first host, where DeepSpeed's runner put "
                     "rank 0")


def _effective_deepspeed(cfg: RunConfig, base: dict[str, object], notes: list[str]) -> dict[str, Any]:
    """The DeepSpeed section, with what its JSON file says filled in where the section is silent."""
    ds = {k: v for k, v in vars(cfg.deepspeed).items() if v is not None}
    path = ds.pop("deepspeed_config_file", None)
    if not path:
        return ds
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"deepspeed_config_file={path!r} cannot be read ({exc}); fix the path or the JSON") from None
    zero = data.get("zero_optimization", {})
    from_json = {"zero_stage": zero.get("stage"),
                 "offload_optimizer_device": (zero.get("offload_optimizer") or {}).get("device"),
                 "offload_param_device": (zero.get("offload_param") or {}).get("device"),
                 "zero3_save_16bit_model": zero.get("stage3_gather_16bit_weights_on_model_save"),
                 "gradient_clipping": data.get("gradient_clipping")}
    for key, value in from_json.items():
        if value is not None and value != "auto" and key not in ds:
            ds[key] = value
            notes.append(f"{key}={value!r}: taken from {path}")
    for dtype in ("bf16", "fp16"):
        if (data.get(dtype) or {}).get("enabled") is True and "mixed_precision" not in base:
            base["mixed_precision"] = dtype
            notes.append(f"mixed_precision={dtype!r}: taken from {dtype}.enabled=true in {path}")
    steps = data.get("gradient_accumulation_steps")
    if isinstance(steps, int) and not isinstance(steps, bool) and "gradient_accumulation_steps" not in base:
        base["gradient_accumulation_steps"] = steps
        notes.append(f"gradient_accumulation_steps={steps}: taken from {path}")
    for key in ("train_micro_batch_size_per_gpu", "train_batch_size"):
        if data.get(key) not in (None, "auto"):
            notes.append(f"{key}={data[key]!r} in {path} has no config key: FSDP takes the batch size from the "
                         "prepared DataLoader (batch_size per rank)")
    notes.append(f"read {path}: its other settings (buckets, optimizer, scheduler) have no FSDP counterpart")
    return ds
