"""FSDP <-> DeepSpeed config translation along the seed's table, with a note for every lossy setting."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from impel.config.convert import convert
from impel.config.run_config import ConfigError, RunConfig
from impel.config.yaml_file import read_config_file

FIXTURES = Path(__file__).resolve().parents[1] / "cli" / "fixtures"


def fsdp(**section):
    return {"distributed_type": "FSDP", "fsdp_config": {f"fsdp_{k}": v for k, v in section.items()}}


def ds(**section):
    return {"distributed_type": "DEEPSPEED", "deepspeed_config": section}


@pytest.mark.parametrize("strategy,stage", [("FULL_SHARD", 3), ("SHARD_GRAD_OP", 2), ("NO_SHARD", 0),
                                            ("HYBRID_SHARD", 3), ("HYBRID_SHARD_ZERO2", 2)])
def test_sharding_maps_to_zero_stages(strategy, stage):
    out, notes = convert(fsdp(sharding_strategy=strategy), "deepspeed")
    assert out["distributed_type"] == "DEEPSPEED" and out["deepspeed_config"]["zero_stage"] == stage
    assert any("hpZ" in n for n in notes) == strategy.startswith("HYBRID")


@pytest.mark.parametrize("stage,strategy", [(3, "FULL_SHARD"), (2, "SHARD_GRAD_OP"), (0, "NO_SHARD")])
def test_zero_stages_map_back(stage, strategy):
    out, _ = convert(ds(zero_stage=stage), "fsdp")
    assert out["fsdp_config"]["fsdp_sharding_strategy"] == strategy
    back, _ = convert(out, "deepspeed")
    assert back["deepspeed_config"]["zero_stage"] == stage  # a round trip lands where it started


def test_zero1_has_no_fsdp_mode_and_says_so():
    out, notes = convert(ds(zero_stage=1), "fsdp")
    assert out["fsdp_config"]["fsdp_sharding_strategy"] == "SHARD_GRAD_OP"
    assert any("ZeRO-1 shards only optimizer states" in n for n in notes)


def test_offload_is_all_or_nothing():
    out, _ = convert(fsdp(sharding_strategy="FULL_SHARD", offload_params=True), "deepspeed")
    assert out["deepspeed_config"] | {} == {"zero_stage": 3, "offload_optimizer_device": "cpu",
                                            "offload_param_device": "cpu", "zero3_save_16bit_model": False}
    out, notes = convert(fsdp(sharding_strategy="SHARD_GRAD_OP", offload_params=True), "deepspeed")
    assert "offload_param_device" not in out["deepspeed_config"]
    assert any("ZeRO-2 can offload only the optimizer" in n for n in notes)
    out, notes = convert(ds(zero_stage=2, offload_optimizer_device="cpu"), "fsdp")
    assert out["fsdp_config"]["fsdp_offload_params"] is True
    assert any("all or nothing" in n for n in notes)


def test_loading_and_saving_rows():
    out, notes = convert(fsdp(cpu_ram_efficient_loading=True, state_dict_type="FULL_STATE_DICT"), "deepspeed")
    assert out["deepspeed_config"]["zero3_init_flag"] is True
    assert out["deepspeed_config"]["zero3_save_16bit_model"] is True and any("16 bits" in n for n in notes)
    out, _ = convert(ds(zero_stage=3, zero3_init_flag=True, zero3_save_16bit_model=False), "fsdp")
    assert out["fsdp_config"]["fsdp_cpu_ram_efficient_loading"] is True
    assert out["fsdp_config"]["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"


def test_transparent_settings_and_precision_are_noted():
    _, notes = convert(read_config_file(str(FIXTURES / "accelerate_fsdp.yaml")), "deepspeed")
    text = "\n".join(notes)
    for key in ("fsdp_auto_wrap_policy", "fsdp_transformer_layer_cls_to_wrap", "fsdp_backward_prefetch",
                "fsdp_forward_prefetch", "fsdp_activation_checkpointing", "gradient clipping"):
        assert key in text
    _, notes = convert(fsdp(sharding_strategy="FULL_SHARD"), "deepspeed")  # mixed_precision 'no'
    assert any("precision behaviour changes" in n for n in notes)


def test_clipping_and_accumulation_carry_over():
    explicit = read_config_file(str(FIXTURES / "accelerate_deepspeed.yaml"))
    out, notes = convert(explicit, "fsdp")
    assert out["gradient_accumulation_steps"] == 4 and out["mixed_precision"] == "bf16"
    assert any("clip_grad_norm_(model.parameters(), 1.0)" in n for n in notes)
    RunConfig.from_dict(out)


def test_deepspeed_json_file_is_read(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                                      "stage3_gather_16bit_weights_on_model_save": True},
                                "bf16": {"enabled": True}, "gradient_clipping": "auto"}))
    out, notes = convert(ds(deepspeed_config_file=str(path)), "fsdp")
    assert out["fsdp_config"] == {"fsdp_sharding_strategy": "FULL_SHARD", "fsdp_offload_params": True,
                                  "fsdp_state_dict_type": "FULL_STATE_DICT"}
    assert out["mixed_precision"] == "bf16" and any(f"read {path}" in n for n in notes)


def test_non_sharded_configs_are_rejected():
    with pytest.raises(ConfigError, match="only FSDP and DEEPSPEED configs translate"):
        convert({"distributed_type": "MULTI_GPU"}, "fsdp")
    with pytest.raises(ConfigError, match="use 'deepspeed' or 'fsdp'"):
        convert(fsdp(), "zero")
