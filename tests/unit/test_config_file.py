"""Accelerate-format config files, flags derived from the dataclasses, and file < flag precedence."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from impel.commands.flags import (
    add_config_flags,
    bool_values_joined,
    config_fields,
    explicit_from_flags,
    merge_file_and_flags,
)
from impel.config.run_config import ConfigError, RunConfig
from impel.config.yaml_file import read_config_file, write_config_file

FIXTURES = Path(__file__).resolve().parents[1] / "cli" / "fixtures"


def test_accelerate_fsdp_file_loads_as_written():
    explicit = read_config_file(str(FIXTURES / "accelerate_fsdp.yaml"))
    cfg = RunConfig.from_dict(explicit)
    assert (cfg.distributed_type, cfg.mixed_precision, cfg.num_processes, cfg.rdzv_backend) == (
        "FSDP", "bf16", 2, "static")
    assert cfg.fsdp.transformer_layer_cls_to_wrap == "BertLayer" and cfg.fsdp.cpu_ram_efficient_loading
    assert "tpu_env" not in explicit and "downcast_bf16" not in explicit  # inert keys are checked, then dropped


def test_legacy_fsdp_file_maps_old_names_and_integer_strategies():
    cfg = RunConfig.from_dict(read_config_file(str(FIXTURES / "accelerate_fsdp_legacy.yaml")))
    fsdp = cfg.fsdp
    assert (fsdp.sharding_strategy, fsdp.backward_prefetch, fsdp.auto_wrap_policy, fsdp.min_num_params) == (
        "SHARD_GRAD_OP", "BACKWARD_POST", "SIZE_BASED_WRAP", 2000)
    assert fsdp.offload_params and cfg.deepspeed_config is None  # `deepspeed_config: {}` means absent


def test_fsdp2_file_reshard_after_forward_sets_the_strategy():
    cfg = RunConfig.from_dict(read_config_file(str(FIXTURES / "accelerate_fsdp2.yaml")))
    assert cfg.fsdp.resolved_sharding_strategy == "SHARD_GRAD_OP" and cfg.use_cpu


def test_deepspeed_accumulation_moves_to_the_top_level(tmp_path):
    cfg = RunConfig.from_dict(read_config_file(str(FIXTURES / "accelerate_deepspeed.yaml")))
    assert cfg.gradient_accumulation_steps == 4 and cfg.deepspeed.zero_stage == 2
    bad = tmp_path / "ds.yaml"
    bad.write_text("distributed_type: DEEPSPEED\ngradient_accumulation_steps: 2\n"
                   "deepspeed_config:\n  gradient_accumulation_steps: 8\n")
    with pytest.raises(ConfigError, match="gradient_accumulation_steps=8 contradicts gradient_accumulation_steps=2"):
        read_config_file(str(bad))


def test_multi_machine_file(tmp_path):
    cfg = RunConfig.from_dict(read_config_file(str(FIXTURES / "accelerate_multi_gpu.yaml")))
    assert (cfg.num_machines, cfg.machine_rank, cfg.main_process_ip, cfg.main_process_port, cfg.rdzv_backend) == (
        2, 1, "10.0.0.1", 29501, "c10d")


def test_unquoted_yaml_no_means_the_string(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("mixed_precision: no\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n  offload_param_device: no\n")
    explicit = read_config_file(str(path))
    assert explicit["mixed_precision"] == "no" and explicit["deepspeed_config"]["offload_param_device"] == "none"


def test_dependent_settings_are_checked():
    with pytest.raises(ConfigError, match="offload_param_device='cpu' needs zero_stage=3"):
        RunConfig.from_dict({"distributed_type": "DEEPSPEED",
                             "deepspeed_config": {"zero_stage": 2, "offload_param_device": "cpu"}})
    with pytest.raises(ConfigError, match="needs offload_optimizer_nvme_path"):
        RunConfig.from_dict({"distributed_type": "DEEPSPEED", "deepspeed_config": {"offload_optimizer_device": "nvme"}})
    with pytest.raises(ConfigError, match="needs fsdp_sync_module_states=true"):
        RunConfig.from_dict({"distributed_type": "FSDP", "fsdp_config": {"fsdp_cpu_ram_efficient_loading": True,
                                                                          "fsdp_sync_module_states": False}})
    with pytest.raises(ConfigError, match="contradicts fsdp_sharding_strategy='FULL_SHARD'"):
        RunConfig.from_dict({"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD",
                                                                          "fsdp_reshard_after_forward": False}})


def test_written_files_load_back(tmp_path):
    explicit = {"distributed_type": "FSDP", "num_processes": 4, "mixed_precision": "bf16",
                "fsdp_config": {"fsdp_sharding_strategy": "HYBRID_SHARD", "fsdp_offload_params": True}}
    path = write_config_file(explicit, str(tmp_path / "sub" / "c.yaml"))
    assert read_config_file(path) == explicit
    with pytest.raises(ConfigError):
        write_config_file({"num_processes": 0}, str(tmp_path / "bad.yaml"))
    assert not (tmp_path / "bad.yaml").exists() and not list(tmp_path.glob(".impel-config-*"))


def _parse(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    parser.add_argument("rest", nargs="*")
    return explicit_from_flags(parser.parse_args(bool_values_joined(["launch", *argv])[1:]))


def test_every_config_field_has_a_flag_that_reaches_its_key():
    samples = {"bool": ("true", True), "int": ("3", 3), "float": ("0.5", 0.5), "str": ("x", "x")}
    for section, key, flag, meta in config_fields():
        if meta["choices"] is not None:
            raw = value = meta["choices"][-1]
            raw = str(raw)
        else:
            raw, value = samples[meta["kind"]]
        got = _parse([f"--{flag}", raw])
        assert (got[section][key] if section else got[key]) == value, flag


def test_bool_flags_alone_or_with_a_value():
    assert _parse(["--cpu"]) == {"use_cpu": True}
    assert _parse(["--cpu", "false", "script.py"]) == {"use_cpu": False}
    assert _parse(["--use_fsdp", "--fsdp_offload_params", "no"]) == {
        "distributed_type": "FSDP", "fsdp_config": {"fsdp_offload_params": False}}


def test_flags_override_the_file_key_by_key():
    merged, notes = merge_file_and_flags(
        {"mixed_precision": "bf16", "distributed_type": "FSDP",
         "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD", "fsdp_offload_params": True}},
        {"fsdp_config": {"fsdp_sharding_strategy": "NO_SHARD"}, "num_processes": 2})
    assert merged == {"mixed_precision": "bf16", "distributed_type": "FSDP", "num_processes": 2,
                      "fsdp_config": {"fsdp_sharding_strategy": "NO_SHARD", "fsdp_offload_params": True}}
    assert notes == []
