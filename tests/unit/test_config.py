"""Run config: validation, one-way merge of code arguments over the launched config, unknown keys."""
from __future__ import annotations

import json
import logging

import pytest

from impel import Accelerator, ConfigError, RunConfig
from impel.config import environment as env
from impel.config.run_config import defaults, merge_code_arguments


def test_defaults():
    cfg = RunConfig().validate()
    assert cfg.to_dict() == defaults()
    assert {k: defaults()[k] for k in ("distributed_type", "mixed_precision", "gradient_accumulation_steps",
                                       "use_cpu", "num_processes", "num_machines", "fsdp_config")} == {
        "distributed_type": None, "mixed_precision": "no", "gradient_accumulation_steps": 1, "use_cpu": False,
        "num_processes": None, "num_machines": 1, "fsdp_config": None}


def test_round_trip_through_a_dict():
    cfg = RunConfig(distributed_type="MULTI_CPU", mixed_precision="bf16", gradient_accumulation_steps=4,
                    use_cpu=True, num_processes=2)
    assert RunConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("key,value,fragment", [
    ("mixed_precision", "fp32", "mixed_precision='fp32' is not allowed; use one of 'no', 'fp16', 'bf16'"),
    ("distributed_type", "TPU", "distributed_type='TPU' is not allowed; use one of 'NO', 'MULTI_CPU'"),
    ("gradient_accumulation_steps", 0, "gradient_accumulation_steps=0 must be an integer >= 1"),
    ("num_processes", -2, "num_processes=-2 must be an integer >= 1"),
    ("use_cpu", "yes", "use_cpu='yes' must be true or false"),
])
def test_validation_names_the_value_and_the_fix(key, value, fragment):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict({key: value})
    assert fragment in str(err.value)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("key,suggestion", [("mixed_precison", "mixed_precision"),
                                            ("gradient_accumulation_step", "gradient_accumulation_steps"),
                                            ("num_process", "num_processes"), ("usecpu", "use_cpu")])
def test_unknown_keys_suggest_the_closest_one(key, suggestion):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict({key: 1})
    assert f"unknown config key {key!r}; did you mean {suggestion!r}?" in str(err.value)


def test_unknown_key_without_a_close_match_has_no_suggestion():
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict({"zzz": 1})
    assert str(err.value) == "unknown config key 'zzz'"


def test_unknown_code_argument_suggests_the_closest_key():
    with pytest.raises(ConfigError, match="did you mean 'mixed_precision'"):
        merge_code_arguments(None, {"mixed_precison": "bf16"})


def test_code_argument_wins_over_the_launched_value_and_logs_both(caplog):
    with caplog.at_level(logging.WARNING, logger="impel"):
        cfg = merge_code_arguments({"mixed_precision": "bf16"}, {"mixed_precision": "fp16"})
    assert cfg.mixed_precision == "fp16"
    assert "sets mixed_precision='fp16', which overrides the launched config's mixed_precision='bf16'" in caplog.text


def test_code_accumulation_steps_win_and_name_both(caplog):
    with caplog.at_level(logging.WARNING, logger="impel"):
        cfg = merge_code_arguments({"gradient_accumulation_steps": 4}, {"gradient_accumulation_steps": 2})
    assert cfg.gradient_accumulation_steps == 2
    assert "gradient_accumulation_steps=2" in caplog.text and "gradient_accumulation_steps=4" in caplog.text


def test_a_different_strategy_in_code_than_launched_raises():
    with pytest.raises(ConfigError, match=r"distributed_type='FSDP'.*launched as distributed_type='DEEPSPEED'"):
        merge_code_arguments({"distributed_type": "DEEPSPEED"}, {"distributed_type": "FSDP"})


def test_cpu_true_in_a_gpu_launched_world_raises():
    with pytest.raises(ConfigError, match=r"cpu=True but the job was launched on GPUs"):
        merge_code_arguments({"distributed_type": "MULTI_GPU"}, {"use_cpu": True})


def test_accelerate_default_config_mixed_precision_no_yields_to_the_code():
    """``accelerate config default`` writes mixed_precision 'no' and use_cpu true; the script's bf16 wins."""
    cfg = merge_code_arguments({"distributed_type": "NO", "mixed_precision": "no", "use_cpu": True},
                               {"mixed_precision": "bf16"})
    assert cfg.mixed_precision == "bf16" and cfg.use_cpu is True


def test_agreeing_or_missing_code_arguments_are_fine():
    launched = {"mixed_precision": "bf16", "gradient_accumulation_steps": 2}
    cfg = merge_code_arguments(launched, {"mixed_precision": "bf16", "gradient_accumulation_steps": None,
                                          "use_cpu": True})
    assert (cfg.mixed_precision, cfg.gradient_accumulation_steps, cfg.use_cpu) == ("bf16", 2, True)


def test_code_arguments_fill_what_was_not_launched():
    cfg = merge_code_arguments(None, {"mixed_precision": "fp16", "gradient_accumulation_steps": 3})
    assert (cfg.mixed_precision, cfg.gradient_accumulation_steps) == ("fp16", 3)
    cfg = merge_code_arguments({"distributed_type": None}, {"distributed_type": "MULTI_CPU"})
    assert cfg.distributed_type == "MULTI_CPU"


# --- a launched false / 0 / "" is a value the launcher set --------------------------------------------------------
# The rule (merge_code_arguments' docstring, as Accelerate): a code argument that contradicts a value the launcher
# set wins, and one log line names both values. What counts as set must not change: only None means "not given",
# so a launched false / 0 / "" is named as overridden (not silently treated as unset).
def assert_contradiction(launched, code, key, launched_value, code_value):
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("impel").addHandler(handler)
    try:
        merge_code_arguments(launched, code)
    finally:
        logging.getLogger("impel").removeHandler(handler)
    text = "\n".join(r.getMessage() for r in records)
    assert f"sets {key}={code_value!r}" in text
    assert f"launched config's {key}={launched_value!r}" in text


def _fsdp(**fields):
    from impel import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(**fields).code_arguments(None)


def _deepspeed(**fields):
    from impel import DeepSpeedPlugin

    return DeepSpeedPlugin(**fields).code_arguments(None)


@pytest.mark.parametrize("launched,code,key,launched_value,code_value", [
    ({"use_cpu": False}, {"use_cpu": True}, "use_cpu", False, True),
    ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_offload_params": False}}, _fsdp(offload_params=True),
     "fsdp_config.fsdp_offload_params", False, True),
    ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_activation_checkpointing": False}},
     _fsdp(activation_checkpointing=True), "fsdp_config.fsdp_activation_checkpointing", False, True),
    ({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 0}}, _deepspeed(zero_stage=2),
     "deepspeed_config.zero_stage", 0, 2),
    ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_transformer_layer_cls_to_wrap": ""}},
     _fsdp(transformer_cls_names_to_wrap=["BertLayer"]), "fsdp_config.fsdp_transformer_layer_cls_to_wrap", "",
     "BertLayer"),
], ids=["use_cpu-false", "offload-false", "checkpointing-false", "zero-stage-0", "layer-cls-empty"])
def test_a_launched_falsy_value_is_set_and_a_contradicting_code_value_is_a_contradiction(
        launched, code, key, launched_value, code_value):
    assert_contradiction(launched, code, key, launched_value, code_value)


def test_a_launched_falsy_value_survives_a_code_argument_left_unset():
    launched = {"use_cpu": False, "distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 0}}
    cfg = merge_code_arguments(launched, {"use_cpu": None, "mixed_precision": None})
    assert cfg.use_cpu is False and cfg.deepspeed.zero_stage == 0  # not a default's None / a plugin's value
    cfg = merge_code_arguments({"distributed_type": "FSDP", "fsdp_config": {"fsdp_offload_params": False}},
                               _fsdp(offload_params=False, activation_checkpointing=True))
    assert cfg.fsdp.offload_params is False and cfg.fsdp.activation_checkpointing is True  # agreeing, and filled


def test_accelerator_cpu_true_against_a_launched_use_cpu_false(monkeypatch, caplog):
    monkeypatch.setenv(env.CONFIG_VAR, json.dumps({"use_cpu": False}))
    with caplog.at_level(logging.WARNING, logger="impel"):
        acc = Accelerator(cpu=True)
    assert acc.device.type == "cpu" and acc.config.use_cpu is True
    assert "sets use_cpu=True, which overrides the launched config's use_cpu=False" in caplog.text


def test_fsdp_plugin_true_against_a_launched_offload_false(monkeypatch, caplog):
    from impel import FullyShardedDataParallelPlugin

    monkeypatch.setenv(env.CONFIG_VAR, json.dumps({"distributed_type": "FSDP",
                                                   "fsdp_config": {"fsdp_offload_params": False}}))
    with caplog.at_level(logging.WARNING, logger="impel"):
        acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(offload_params=True))
    assert acc.config.fsdp.offload_params is True
    assert "fsdp_offload_params=True, which overrides the launched config's fsdp_config.fsdp_offload_params=False" \
        in caplog.text


def test_merged_values_are_validated():
    with pytest.raises(ConfigError, match="'fp32'"):
        merge_code_arguments({}, {"mixed_precision": "fp32"})
    with pytest.raises(ConfigError, match="'fp32'"):
        merge_code_arguments({"mixed_precision": "fp32"}, {})


def test_accelerator_reads_the_launched_config(monkeypatch):
    monkeypatch.setenv(env.CONFIG_VAR, json.dumps({"mixed_precision": "bf16", "gradient_accumulation_steps": 3}))
    acc = Accelerator(cpu=True)
    assert acc.mixed_precision == "bf16"
    assert acc.gradient_accumulation_steps == 3


def test_accelerator_argument_contradicting_the_launch_wins(monkeypatch, caplog):
    monkeypatch.setenv(env.CONFIG_VAR, json.dumps({"mixed_precision": "bf16"}))
    with caplog.at_level(logging.WARNING, logger="impel"):
        acc = Accelerator(cpu=True, mixed_precision="fp16")
    assert acc.mixed_precision == "fp16"
    assert "'fp16'" in caplog.text and "'bf16'" in caplog.text


def test_launched_num_processes_must_match_the_world(monkeypatch):
    monkeypatch.setenv(env.CONFIG_VAR, json.dumps({"num_processes": 2}))
    with pytest.raises(ConfigError, match="num_processes=2.*WORLD_SIZE=1"):
        Accelerator(cpu=True)


def test_launched_distributed_type_no_is_fine_on_one_process(monkeypatch):
    monkeypatch.setenv(env.CONFIG_VAR, json.dumps({"distributed_type": "NO"}))
    assert Accelerator(cpu=True).distributed_type == "NO"


def test_launch_config_round_trip_and_errors():
    environ: dict[str, str] = {}
    env.write_launch_config({"mixed_precision": "bf16"}, environ)
    assert env.read_launch_config(environ) == {"mixed_precision": "bf16"}
    assert env.read_launch_config({}) is None
    with pytest.raises(ValueError, match="not valid JSON"):
        env.read_launch_config({env.CONFIG_VAR: "{bad"})
    with pytest.raises(ValueError, match="JSON object"):
        env.read_launch_config({env.CONFIG_VAR: "[1]"})


def test_topology_from_the_environment():
    assert env.read_topology({}) == env.Topology()
    topo = env.read_topology({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"})
    assert (topo.rank, topo.world_size, topo.local_rank, topo.master_port, topo.distributed) == (1, 2, 1, 29500, True)
    with pytest.raises(ValueError, match="torchrun: rank 2 of world size 2 is not a valid placement"):
        env.read_topology({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="WORLD_SIZE='two'"):
        env.read_topology({"WORLD_SIZE": "two"})
