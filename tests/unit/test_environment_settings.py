"""Accelerate's ACCELERATE_* / FSDP_* variables (and IMPEL_* names) configure a run as in Accelerate: code argument >
environment > config file; a variable impel cannot honour, or a bad value, raises naming the variable."""
from __future__ import annotations

import argparse

import pytest

from impel import Accelerator, ConfigError
from impel.config.environment_settings import describe, environment_settings


def test_variables_set_the_run_and_code_arguments_win(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    monkeypatch.setenv("ACCELERATE_DEBUG_MODE", "true")
    acc = Accelerator()
    assert (acc.mixed_precision, acc.gradient_accumulation_steps, acc.config.debug) == ("bf16", 4, True)
    acc = Accelerator(mixed_precision="no", gradient_accumulation_steps=2)
    assert (acc.mixed_precision, acc.gradient_accumulation_steps) == ("no", 2)


def test_impel_names_win_over_accelerates(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    monkeypatch.setenv("IMPEL_MIXED_PRECISION", "bf16")
    assert environment_settings() == {"mixed_precision": "bf16"}
    assert describe() == ["IMPEL_MIXED_PRECISION=bf16 -> mixed_precision"]


def test_dynamo_variables_as_accelerate_reads_them(monkeypatch):
    for name, value in {"BACKEND": "eager", "MODE": "reduce-overhead", "USE_FULLGRAPH": "True",
                        "USE_DYNAMIC": "False", "USE_REGIONAL_COMPILATION": "false"}.items():
        monkeypatch.setenv("ACCELERATE_DYNAMO_" + name, value)
    acc = Accelerator()
    plugin = acc.state.dynamo_plugin
    assert (plugin.backend.value, plugin.mode, plugin.fullgraph, plugin.dynamic) == ("EAGER", "reduce-overhead",
                                                                                      True, False)


def test_use_cpu_and_strategy_variables(monkeypatch):
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")  # ignored without ACCELERATE_USE_FSDP, as in Accelerate
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    assert environment_settings() == {"use_cpu": True}
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_SHARDING_STRATEGY", "2")  # Accelerate's launcher may write FSDP1's numbers
    monkeypatch.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "Block")
    assert environment_settings() == {"use_cpu": True, "distributed_type": "FSDP", "fsdp_config": {
        "fsdp_offload_params": True, "fsdp_sharding_strategy": "SHARD_GRAD_OP",
        "fsdp_transformer_layer_cls_to_wrap": "Block"}}
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ConfigError, match="both ACCELERATE_USE_FSDP and ACCELERATE_USE_DEEPSPEED"):
        environment_settings()
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")  # Accelerate's launcher's "not set"
    assert environment_settings() == {"use_cpu": True, "distributed_type": "DEEPSPEED",
                                      "deepspeed_config": {"zero_stage": 3}}


@pytest.mark.parametrize(("name", "value", "fragment"), [
    ("ACCELERATE_MIXED_PRECISION", "fp32", "ACCELERATE_MIXED_PRECISION='fp32': mixed_precision='fp32' is not allowed"),
    ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "four", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS='four'"),
    ("IMPEL_USE_CPU", "maybe", "IMPEL_USE_CPU='maybe': use_cpu='maybe' must be true or false"),
    ("ACCELERATE_USE_MEGATRON_LM", "true", "ACCELERATE_USE_MEGATRON_LM='true' selects Megatron-LM"),
    ("ACCELERATE_FP8_BACKEND", "TE", "ACCELERATE_FP8_BACKEND='TE' selects fp8 training"),
])
def test_a_variable_impel_cannot_honour_raises_naming_it(monkeypatch, name, value, fragment):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")):
        Accelerator()


def test_off_values_of_refused_variables_are_fine(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_MEGATRON_LM", "false")
    monkeypatch.setenv("ACCELERATE_FP8_BACKEND", "NO")
    assert environment_settings() == {}


def _plan(tmp_path, *flags):
    from impel.commands.flags import bool_values_joined
    from impel.commands.launch import plan_launch
    from impel.commands.main import build_parser

    (tmp_path / "train.py").write_text("")
    (tmp_path / "c.yaml").write_text("mixed_precision: fp16\ngradient_accumulation_steps: 3\n")
    argv = ["launch", "--config_file", str(tmp_path / "c.yaml"), "--cpu", *flags, str(tmp_path / "train.py")]
    return plan_launch(build_parser().parse_args(bool_values_joined(argv)))


def test_impel_launch_puts_the_environment_between_file_and_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    plan = _plan(tmp_path, "--gradient_accumulation_steps", "2")
    assert (plan.config.mixed_precision, plan.config.gradient_accumulation_steps) == ("bf16", 2)
    assert any("ACCELERATE_MIXED_PRECISION=bf16 -> mixed_precision" in note for note in plan.notes)


def test_cpu_ranks_get_accelerates_use_cpu_as_accelerate_launch_cpu_sets_it(tmp_path, monkeypatch):
    """transformers' TrainingArguments asks Accelerate's own state for the world: without the variable, each CPU
    rank would see a world of one. One process needs nothing; a value the user exported is left alone."""
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    assert _plan(tmp_path, "--num_processes", "2").rank_variables["ACCELERATE_USE_CPU"] == "true"
    assert "ACCELERATE_USE_CPU" not in _plan(tmp_path).rank_variables
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # no --cpu, GPUs: the ranks run on them
    (tmp_path / "g.yaml").write_text("distributed_type: MULTI_GPU\nnum_processes: 2\n")
    from impel.commands.flags import bool_values_joined
    from impel.commands.launch import plan_launch
    from impel.commands.main import build_parser

    gpu = plan_launch(build_parser().parse_args(bool_values_joined(
        ["launch", "--config_file", str(tmp_path / "g.yaml"), str(tmp_path / "train.py")])))
    assert "ACCELERATE_USE_CPU" not in gpu.rank_variables
    monkeypatch.setenv("ACCELERATE_USE_CPU", "false")
    assert "ACCELERATE_USE_CPU" not in _plan(tmp_path, "--num_processes", "2").rank_variables


def test_impel_env_names_the_variables(monkeypatch, capsys, tmp_path):
    from impel.commands import env as env_command

    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "cuda:1")
    env_command.main(argparse.Namespace(config_file=str(tmp_path / "absent.yaml")))
    out = capsys.readouterr().out
    assert "ACCELERATE_GRADIENT_ACCUMULATION_STEPS=4 -> gradient_accumulation_steps" in out
    assert "device named by ACCELERATE_TORCH_DEVICE: cuda:1" in out


@pytest.mark.parametrize(("same_network", "expected"), [
    ("true", ["--master_addr", "10.0.0.1", "--master_port", "29400"]),
    ("false", ["--rdzv_endpoint", "10.0.0.1:29400"])])
def test_same_network_picks_torchruns_rendezvous_spelling_as_accelerate_launch(tmp_path, same_network, expected):
    plan = _plan(tmp_path, "--num_machines", "2", "--num_processes", "2", "--main_process_ip", "10.0.0.1",
                 "--main_process_port", "29400", "--same_network", same_network)
    args = plan.torchrun_args
    at = args.index("static") + 1
    assert args[at:at + len(expected)] == expected and args[args.index("--node_rank") + 1] == "0"
