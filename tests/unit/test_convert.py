"""FSDP <-> DeepSpeed config translation along the seed's table, with a note for every lossy setting."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from impel.config.convert import convert
from impel.config.run_config import ConfigError, RunConfig
from impel.config.yaml_file import load_config_mapping, read_config_file

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


def test_every_value_taken_from_the_deepspeed_json_is_noted(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "fp16": {"enabled": True},
                                "gradient_accumulation_steps": 4, "train_micro_batch_size_per_gpu": 8}))
    out, notes = convert(ds(deepspeed_config_file=str(path)), "fsdp")
    assert out["gradient_accumulation_steps"] == 4 and out["mixed_precision"] == "fp16"  # carried, not dropped
    assert out["fsdp_config"] == {"fsdp_sharding_strategy": "SHARD_GRAD_OP"}
    for note in (f"zero_stage=2: taken from {path}", "zero_stage=2 -> fsdp_sharding_strategy=SHARD_GRAD_OP",
                 f"mixed_precision='fp16': taken from fp16.enabled=true in {path}",
                 f"gradient_accumulation_steps=4: taken from {path}",
                 f"train_micro_batch_size_per_gpu=8 in {path} has no config key"):
        assert any(n.startswith(note) for n in notes), (note, notes)
    RunConfig.from_dict(out)


# --- every Accelerate-written file converts, round trips keep what has a counterpart, the output launches ----------
FSDP1 = FIXTURES / "fsdp1" / "accelerate_fsdp1.yaml"  # fsdp_version 1: impel launch refuses it, convert takes it
ACCELERATE_FILES = [*sorted(FIXTURES.glob("*.yaml")), FSDP1]
FSDP_FILES = [p for p in ACCELERATE_FILES if load_config_mapping(str(p))["distributed_type"] == "FSDP"]
DEEPSPEED_FILES = [p for p in ACCELERATE_FILES if load_config_mapping(str(p))["distributed_type"] == "DEEPSPEED"]
GENERATED_FSDP = [fsdp(sharding_strategy=s, offload_params=o, cpu_ram_efficient_loading=r, **extra)
                  for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD") for o in (False, True) for r in (False, True)
                  for extra in ({}, {"state_dict_type": "FULL_STATE_DICT"}, {"version": 1})]
GENERATED_DS = [ds(zero_stage=z, offload_optimizer_device=o, offload_param_device=o if z == 3 else "none", **extra)
                for z in (0, 2, 3) for o in (("none", "cpu") if z else ("none",))
                for extra in ({}, {"zero3_save_16bit_model": False}, *([{"zero3_save_16bit_model": True}] * (z == 3)))
                ] + [ds(zero_stage=3, zero3_init_flag=True, zero3_save_16bit_model=s) for s in (False, True)]


def _shared(cfg: RunConfig) -> dict:
    return {k: v for k, v in cfg.to_dict().items() if k not in ("distributed_type", "fsdp_config", "deepspeed_config")}


def _fsdp_counterparts(explicit):
    cfg = RunConfig.from_dict(explicit)
    strategy = cfg.fsdp.resolved_sharding_strategy
    zero3 = strategy == "FULL_SHARD"  # ZeRO-3 alone has the loading and saving switches; ZeRO-0 offloads nothing
    return {"shared": _shared(cfg), "strategy": strategy, "offload": cfg.fsdp.offload_params and strategy != "NO_SHARD",
            "state_dict_type": cfg.fsdp.state_dict_type if zero3 else None,
            "ram_efficient": cfg.fsdp.cpu_ram_efficient_loading if zero3 else None}


def _deepspeed_counterparts(explicit):
    cfg = RunConfig.from_dict(explicit)
    d = cfg.deepspeed
    devices = {d.offload_optimizer_device or "none", d.offload_param_device or "none"}
    stage = 2 if d.zero_stage is None else d.zero_stage
    return {"shared": _shared(cfg), "stage": stage, "offload": devices != {"none"},
            "zero3_init_flag": bool(d.zero3_init_flag),
            "save_16bit": bool(d.zero3_save_16bit_model) if stage == 3 else None}


def _without_version_1(explicit):
    section = {k: v for k, v in explicit["fsdp_config"].items() if k != "fsdp_version" or str(v) != "1"}
    return {**explicit, "fsdp_config": section}


def _launches(explicit, tmp_path, name):
    """The written file passes everything impel launch checks before a rank starts."""
    from impel.commands.flags import bool_values_joined
    from impel.commands.launch import plan_launch
    from impel.commands.main import build_parser
    from impel.config.yaml_file import write_config_file

    (tmp_path / "train.py").write_text("")
    path = write_config_file(explicit, str(tmp_path / f"{name}.yaml"))
    argv = ["launch", "--config_file", path, str(tmp_path / "train.py")]
    plan = plan_launch(build_parser().parse_args(bool_values_joined(argv)))
    assert plan.config.distributed_type == explicit["distributed_type"]


@pytest.mark.parametrize("source", FSDP_FILES + GENERATED_FSDP,
                         ids=lambda s: s.name if isinstance(s, Path) else str(sorted(s["fsdp_config"].items())))
def test_fsdp_to_deepspeed_and_back_keeps_every_counterpart(source, tmp_path):
    explicit = load_config_mapping(str(source)) if isinstance(source, Path) else source
    there, notes = convert(explicit, "deepspeed")
    section = there["deepspeed_config"]
    assert section.get("zero3_init_flag") is not True or section["zero_stage"] == 3, section  # the issue-39 file
    back, _ = convert(there, "fsdp")
    assert _fsdp_counterparts(back) == _fsdp_counterparts(_without_version_1(explicit))
    if str(explicit["fsdp_config"].get("fsdp_version")) == "1":
        assert any("fsdp_version=1 (FSDP1) read as FSDP2" in n and "impel to-fsdp2" in n for n in notes)
    _launches(there, tmp_path, "ds")
    _launches(back, tmp_path, "fsdp")


@pytest.mark.parametrize("source", DEEPSPEED_FILES + GENERATED_DS,
                         ids=lambda s: s.name if isinstance(s, Path) else str(sorted(s["deepspeed_config"].items())))
def test_deepspeed_to_fsdp_and_back_keeps_every_counterpart(source, tmp_path):
    explicit = read_config_file(str(source)) if isinstance(source, Path) else source
    there, _ = convert(explicit, "fsdp")
    back, _ = convert(there, "deepspeed")
    want, got = _deepspeed_counterparts(explicit), _deepspeed_counterparts(back)
    if want["stage"] == 2:  # ZeRO-2 offloads only the optimizer: FSDP's all-or-nothing offload comes back as that
        assert (back["deepspeed_config"].get("offload_param_device") or "none") == "none"
    assert got == want
    _launches(there, tmp_path, "fsdp")
    _launches(back, tmp_path, "ds")


def test_shard_grad_op_with_ram_efficient_loading_never_writes_zero3_init_flag():
    """issue 39: SHARD_GRAD_OP + fsdp_cpu_ram_efficient_loading wrote zero_stage 2 with zero3_init_flag: true."""
    out, notes = convert(load_config_mapping(str(FSDP1)), "deepspeed")
    assert out["deepspeed_config"]["zero_stage"] == 2 and "zero3_init_flag" not in out["deepspeed_config"]
    assert any("fsdp_cpu_ram_efficient_loading has no ZeRO-2 counterpart" in n for n in notes)


def test_the_command_converts_an_fsdp1_file_impel_launch_refuses(tmp_path, capsys):
    from impel.commands.main import main

    assert main(["config", "convert", "--to", "deepspeed", str(FSDP1), "-o", str(tmp_path / "ds.yaml")]) == 0
    assert "note: fsdp_version=1 (FSDP1) read as FSDP2" in capsys.readouterr().err
    assert read_config_file(str(tmp_path / "ds.yaml"))["deepspeed_config"]["zero_stage"] == 2
    assert main(["config", "convert", "--to", "fsdp", str(tmp_path / "ds.yaml"), "-o", str(tmp_path / "f.yaml")]) == 0
    assert read_config_file(str(tmp_path / "f.yaml"))["fsdp_config"]["fsdp_sharding_strategy"] == "SHARD_GRAD_OP"
