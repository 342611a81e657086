"""accelerate launch's flags without a config key (issue 39): ``--env`` reaches every rank, ``--main_training_function
main`` and the other flags' off values are taken, and each setting impel cannot honour refuses naming its reason.
The flag names are checked against the installed Accelerate's own launch parser."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from impel.commands.launch import plan_launch
from impel.commands.main import build_parser, parse
from impel.config.run_config import ConfigError

REFUSED = [  # (flags, what the error names)
    (["--enable_cpu_affinity"], "--enable_cpu_affinity asks for CPU affinity per GPU, which impel does not set; pin"),
    (["--downcast_bf16"], "--downcast_bf16 is for TPUs (torch_xla), which impel does not drive; remove it"),
    (["--main_training_function", "train"], "--main_training_function 'train' names the function Accelerate's TPU"),
    (["--deepspeed_moe_layer_cls_names", "MixtralSparseMoeBlock"], "call deepspeed.utils.set_z3_leaf_modules"),
    (["--fsdp_activation_checkpointing_offload", "true"], "use --fsdp_activation_checkpointing true alone"),
    (["--parallelism_config_sp_seq_length", "4096"], "DeepSpeed sequence parallelism (Ulysses), which impel does not"),
    (["--parallelism_config_sp_seq_length_is_variable", "false"], "--parallelism_config_sp_size must be 1"),
    (["--parallelism_config_sp_attn_implementation", "flash_attention_2"], "remove it"),
    (["--env", "NO_EQUALS"], "--env 'NO_EQUALS' must be KEY=VALUE"),
    (["--env", "ACCELERATE_MIXED_PRECISION=bf16"], "impel launch sets ACCELERATE_MIXED_PRECISION itself"),
    (["--env", "OMP_NUM_THREADS=4"], "--num_cpu_threads_per_process"),
    (["--tpu"], "--tpu is for TPUs (torch_xla) and TPU pods, which impel does not drive; remove it"),
    (["--vm", "tpu-vm-1"], "--vm is for TPUs"),
    (["--use_megatron_lm"], "--use_megatron_lm is a Megatron-LM setting, and impel does not run Megatron-LM"),
    (["--megatron-lm-tp-degree", "2"], "--megatron_lm_tp_degree is a Megatron-LM setting"),
    (["--fp8_format", "HYBRID"], "--fp8_format is an FP8 training setting, and impel does not train in FP8"),
    (["--aws_access_key_id", "AKIA"], "--aws_access_key_id is for Amazon SageMaker launches, which impel does not"),
]
TAKEN = [["--main_training_function", "main"], ["--fsdp_activation_checkpointing_offload", "false"],
         ["--parallelism_config_sp_seq_length_is_variable", "true"],
         ["--parallelism_config_sp_attn_implementation", "sdpa"], ["--parallelism_config_sp_size", "1"]]


def _plan(tmp_path, flags):
    (tmp_path / "train.py").write_text("")
    (tmp_path / "c.yaml").write_text("{}\n")
    return plan_launch(parse(build_parser(), ["launch", "--config_file", str(tmp_path / "c.yaml"), *flags, "--cpu",
                                              str(tmp_path / "train.py")]))


def test_every_flag_of_accelerate_launch_is_known():
    """Each of accelerate launch's flags (either spelling) parses under impel launch: taken, or refused by its
    check with the reason, never argparse's "unrecognized arguments"."""
    from accelerate.commands.launch import launch_command_parser

    from impel.commands.flags import underscored

    launch = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["launch"]
    ours = set(launch._option_string_actions)
    theirs = {s for a in launch_command_parser()._actions for s in a.option_strings if s.startswith("--")}
    assert sorted(f for f in theirs if underscored(f) not in ours) == []


def test_role_goes_to_torchruns_agent(tmp_path):
    assert _plan(tmp_path, ["--num_processes", "2", "--role", "trainer"]).agent_args == ["--role", "trainer"]


def test_the_flags_are_accelerates():
    from accelerate.commands.launch import launch_command_parser

    theirs = {s for a in launch_command_parser()._actions for s in a.option_strings}
    for flags, _ in REFUSED + [(f, "") for f in TAKEN]:
        assert flags[0] in theirs, flags[0]


@pytest.mark.parametrize("flags,error", REFUSED, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_a_setting_impel_cannot_honour_refuses_with_its_reason(flags, error, tmp_path):
    with pytest.raises(ConfigError, match=error.replace("(", r"\(").replace(")", r"\)")):
        _plan(tmp_path, flags)


def test_off_values_are_taken_and_env_reaches_every_rank(tmp_path):
    for flags in TAKEN:
        _plan(tmp_path, flags)
    plan = _plan(tmp_path, ["--env", "DROPIN_A=1", "--env", "DROPIN_B=x=y"])
    assert plan.rank_variables["DROPIN_A"] == "1" and plan.rank_variables["DROPIN_B"] == "x=y"
    script = tmp_path / "show.py"
    script.write_text("import os, sys\nopen(sys.argv[1], 'w').write(os.environ['DROPIN_A'] + os.environ['DROPIN_B'])\n")
    out = tmp_path / "out.txt"
    code = subprocess.run([sys.executable, "-m", "impel.commands.main", "launch", "--cpu", "--env", "DROPIN_A=1",
                           "--env", "DROPIN_B=x=y", str(script), str(out)], cwd=tmp_path, timeout=120,
                          check=False).returncode
    assert code == 0 and out.read_text() == "1x=y"
