"""Every bad input to ``impel launch`` gives one paragraph naming the problem and the fix, exit code 2, no Python
traceback, and no process started (the script would leave a marker file)."""
from __future__ import annotations

import pytest
from cli_helpers import SCRIPTS, impel

from impel.commands import launch
from impel.commands.main import main

REPORT = str(SCRIPTS / "report.py")

BAD_FILES = {
    "unknown_key": ("mixed_precison: bf16\n", ["unknown config key 'mixed_precison'", "did you mean 'mixed_precision'"]),
    "unknown_section_key": ("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_stratgy: FULL_SHARD\n",
                            ["unknown fsdp_config key 'fsdp_sharding_stratgy'", "'fsdp_sharding_strategy'"]),
    "wrong_type": ("num_processes: two\n", ["num_processes='two' must be an integer"]),
    "bad_choice": ("mixed_precision: fp32\n", ["mixed_precision='fp32' is not allowed", "'no', 'fp16', 'bf16'"]),
    "bad_section_choice": ("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: EVERYTHING\n",
                           ["fsdp_sharding_strategy='EVERYTHING' is not allowed", "'FULL_SHARD'"]),
    "bad_zero_stage": ("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 4\n",
                       ["zero_stage=4 is not a DeepSpeed ZeRO stage; use 0, 1, 2 or 3"]),
    "both_strategies": ("distributed_type: FSDP\ndeepspeed_config:\n  zero_stage: 3\n",
                        ["deepspeed_config is set but distributed_type='FSDP'"]),
    "not_yaml": ("mixed_precision: [bf16\n", ["is not valid YAML at line", "fix the syntax"]),
    "not_a_mapping": ("- mixed_precision\n- bf16\n", ["must hold a mapping of keys to values, not a list"]),
    "tpu_setting_on": ("downcast_bf16: 'yes'\n", ["downcast_bf16='yes' is a TPU setting", "remove the key"]),
    "orig_params_off": ("distributed_type: FSDP\nfsdp_config:\n  fsdp_use_orig_params: false\n",
                        ["fsdp_use_orig_params=false has no FSDP2 equivalent"]),
}

BAD_FLAGS = {
    "zero_processes": (["--num_processes", "0"], ["--num_processes=0 must be an integer >= 1"]),
    "fsdp_and_deepspeed": (["--use_fsdp", "--use_deepspeed"], ["--use_fsdp and --use_deepspeed were both given"]),
    "bad_flag_choice": (["--mixed_precision", "fp8"], ["--mixed_precision='fp8' is not allowed"]),
    "bad_bool": (["--cpu=maybe"], ["--cpu='maybe' must be true or false"]),
    "flag_for_absent_strategy": (["--fsdp_sharding_strategy", "FULL_SHARD"],
                                 ["fsdp_config is set but distributed_type=None", "--use_fsdp"]),
    "uneven_machines": (["--num_processes", "3", "--num_machines", "2", "--main_process_ip", "127.0.0.1"],
                        ["num_processes=3 is not a multiple of num_machines=2"]),
    "machines_without_ip": (["--num_machines", "2"], ["needs main_process_ip"]),
    "cpu_and_multi_gpu": (["--cpu", "--multi_gpu"], ["use_cpu=true contradicts distributed_type='MULTI_GPU'"]),
    "missing_config_file": (["--config_file", "nowhere.yaml"], ["config file 'nowhere.yaml' does not exist",
                                                                 "impel config"]),
}


def _assert_clean_failure(res, fragments, marker):
    assert res.returncode == 2, res.output
    assert "Traceback" not in res.output
    for fragment in fragments:
        assert fragment in res.stderr, res.stderr
    assert res.stderr.startswith("impel launch: error:") and res.stderr.count("\n") == 1, res.stderr
    assert not marker.exists(), "a process started despite the bad input"


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_config_file(name, tmp_path):
    text, fragments = BAD_FILES[name]
    (tmp_path / "bad.yaml").write_text(text)
    marker = tmp_path / "started"
    res = impel(["launch", "--config_file", "bad.yaml", REPORT, "--touch", str(marker)], tmp_path)
    _assert_clean_failure(res, fragments + ["bad.yaml"], marker)


@pytest.mark.parametrize("name", sorted(BAD_FLAGS))
def test_bad_flags(name, tmp_path):
    flags, fragments = BAD_FLAGS[name]
    marker = tmp_path / "started"
    res = impel(["launch", *flags, REPORT, "--touch", str(marker)], tmp_path)
    _assert_clean_failure(res, fragments, marker)


def test_missing_script(tmp_path):
    res = impel(["launch", "--cpu", "--num_processes", "2", "train_missing.py"], tmp_path)
    _assert_clean_failure(res, ["script 'train_missing.py' does not exist", "check the path"], tmp_path / "x")


def test_missing_module(tmp_path):
    res = impel(["launch", "-m", "no_such_module_anywhere"], tmp_path)
    _assert_clean_failure(res, ["module 'no_such_module_anywhere' cannot be found"], tmp_path / "x")


def test_bad_deepspeed_json(tmp_path):
    (tmp_path / "ds.json").write_text("{not json")
    res = impel(["launch", "--use_deepspeed", "--deepspeed_config_file", "ds.json", REPORT], tmp_path)
    _assert_clean_failure(res, ["deepspeed_config_file='ds.json' is not valid JSON"], tmp_path / "x")


def test_deepspeed_requested_but_not_installed(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(launch, "deepspeed_available", lambda: False)
    monkeypatch.setenv("IMPEL_CONFIG_FILE", str(tmp_path / "none.yaml"))
    marker = tmp_path / "started"
    code = main(["launch", "--use_deepspeed", REPORT, "--touch", str(marker)])
    err = capsys.readouterr().err
    assert code == 2 and "needs DeepSpeed, which is not installed" in err and "pip install 'impel[deepspeed]'" in err
    assert not marker.exists()


def test_unknown_flag_is_an_argparse_error(tmp_path):
    res = impel(["launch", "--mixed_precison", "bf16", REPORT], tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.output
    assert "unrecognized arguments: --mixed_precison" in res.stderr or "--mixed_precison" in res.stderr
