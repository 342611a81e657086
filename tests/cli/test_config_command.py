"""``impel config`` (piped questionnaire, default, show, validate), ``impel env`` and the torch-free commands."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from cli_helpers import FIXTURES, SCRIPTS, clean_env, impel

# distribution, machines (1), processes, cpu only, precision, accumulation (leave it to the script), then FSDP's:
# sharding, offload, wrap policy, layer class, backward prefetch, forward prefetch, state dict, RAM-efficient
# loading, activation checkpointing; N-D parallelism (no)
FSDP_ANSWERS = """fsdp

2
yes
bf16

shard_grad_op
no
TRANSFORMER_BASED_WRAP
GPT2Block
BACKWARD_POST

FULL_STATE_DICT

yes
no
"""


def test_piped_answers_write_an_fsdp_config(tmp_path):
    res = impel(["config", "--config_file", "fsdp.yaml"], tmp_path, stdin=FSDP_ANSWERS)
    assert res.returncode == 0, res.output
    written = yaml.safe_load((tmp_path / "fsdp.yaml").read_text())
    assert written == {
        "compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "mixed_precision": "bf16",
        "use_cpu": True, "num_processes": 2, "num_machines": 1,
        "fsdp_config": {"fsdp_sharding_strategy": "SHARD_GRAD_OP", "fsdp_offload_params": False,
                        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                        "fsdp_transformer_layer_cls_to_wrap": "GPT2Block", "fsdp_backward_prefetch": "BACKWARD_POST",
                        "fsdp_forward_prefetch": False, "fsdp_state_dict_type": "FULL_STATE_DICT",
                        "fsdp_cpu_ram_efficient_loading": False, "fsdp_activation_checkpointing": True}}


def test_piped_answers_then_launch_runs_with_them(tmp_path):
    answers = "MULTI_CPU\n1\n2\nbf16\n2\n\n"  # distribution, machines, processes, precision, accumulation, mesh
    res = impel(["config"], tmp_path, stdin=answers)
    assert res.returncode == 0, res.output
    assert (tmp_path / "cache" / "impel" / "default_config.yaml").is_file()
    res = impel(["launch", str(SCRIPTS / "report.py"), "accelerator"], tmp_path)
    assert res.returncode == 0, res.output
    reports = res.reports()
    assert [(r["rank"], r["world"]) for r in reports] == [(0, 2), (1, 2)]
    cfg = reports[0]["config"]
    assert (cfg["mixed_precision"], cfg["gradient_accumulation_steps"], cfg["use_cpu"]) == ("bf16", 2, True)


def test_a_wrong_piped_answer_fails_with_exit_2_and_writes_nothing(tmp_path):
    res = impel(["config", "--config_file", "x.yaml"], tmp_path, stdin="MULTI_CPU\n1\nzero\n")
    assert res.returncode == 2 and "Traceback" not in res.output
    assert "num_processes='zero' must be an integer" in res.stderr
    assert not (tmp_path / "x.yaml").exists()


def test_running_out_of_answers_is_a_clear_error(tmp_path):
    res = impel(["config", "--config_file", "x.yaml"], tmp_path, stdin="FSDP\n")
    assert res.returncode == 2 and "the answers ended before the question for 'num_machines'" in res.stderr
    assert not (tmp_path / "x.yaml").exists()


def test_config_default_from_the_hardware_and_no_overwrite(tmp_path):
    res = impel(["config", "default", "--mixed_precision", "bf16"], tmp_path)
    assert res.returncode == 0, res.output
    written = yaml.safe_load((tmp_path / "cache" / "impel" / "default_config.yaml").read_text())
    assert written["distributed_type"] == "NO" and written["num_processes"] == 1  # this machine has no GPU
    assert written["use_cpu"] is True and written["mixed_precision"] == "bf16"
    again = impel(["config", "default"], tmp_path)
    assert again.returncode == 2 and "already exists; pass --overwrite" in again.stderr


def test_config_file_location_honours_impel_config_file(tmp_path):
    target = tmp_path / "elsewhere" / "cfg.yaml"
    res = impel(["config", "default"], tmp_path, IMPEL_CONFIG_FILE=str(target))
    assert res.returncode == 0 and target.is_file()
    res = impel(["config", "show"], tmp_path, IMPEL_CONFIG_FILE=str(target))
    assert f"# {target}" in res.stdout


def test_config_show_prints_the_file_and_the_resolved_config(tmp_path):
    res = impel(["config", "show", "--config_file", str(FIXTURES / "accelerate_deepspeed.yaml")], tmp_path)
    assert res.returncode == 0, res.output
    file_part, resolved_part = res.stdout.split("# resolved")
    assert "zero_stage: 2" in file_part and "gradient_accumulation_steps: 4" in file_part
    resolved = yaml.safe_load(resolved_part.split("\n", 1)[1])
    assert resolved["deepspeed_config"]["offload_optimizer_device"] == "cpu" and resolved["max_restarts"] == 0


def test_config_show_without_a_file_shows_the_defaults(tmp_path):
    res = impel(["config", "show"], tmp_path)
    assert res.returncode == 0 and "no config file at" in res.stdout and "mixed_precision: 'no'" in res.stdout


@pytest.mark.parametrize("fixture", sorted(p.name for p in FIXTURES.glob("*.yaml")))
def test_accelerate_files_validate(fixture, tmp_path):
    res = impel(["config", "validate", str(FIXTURES / fixture)], tmp_path)
    assert res.returncode == 0 and ": valid" in res.stdout, res.output


def test_validate_rejects_a_bad_file(tmp_path):
    (tmp_path / "bad.yaml").write_text("distributed_type: FSPD\n")
    res = impel(["config", "validate", "bad.yaml"], tmp_path)
    assert res.returncode == 2 and "distributed_type='FSPD' is not allowed" in res.stderr


def test_an_empty_config_and_dev_null_say_every_setting_is_default(tmp_path):
    (tmp_path / "empty.yaml").write_text("")
    for name in ("empty.yaml", "/dev/null"):
        res = impel(["config", "validate", name], tmp_path)
        assert res.returncode == 0 and "valid (empty: every setting takes its default)" in res.stdout, res.output
    res = impel(["config", "validate", "missing.yaml"], tmp_path)
    assert res.returncode == 2 and "'missing.yaml' does not exist" in res.stderr


def test_env_reports_versions_devices_and_config(tmp_path):
    res = impel(["env"], tmp_path)
    assert res.returncode == 0, res.output
    for fragment in ("- impel: ", "- Python: 3.", "- torch: ", "CUDA available: False", "- deepspeed: ",
                     "- transformers: ", "config file:", "```yaml", "distributed_type: null"):
        assert fragment in res.stdout, res.stdout


@pytest.mark.parametrize("argv", [["--help"], ["config", "show"], ["launch", "--help"], ["config", "--help"]])
def test_help_and_config_show_do_not_import_torch(argv, tmp_path):
    code = ("import sys, contextlib, io\nfrom impel.commands.main import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try:\n        main(sys.argv[1:])\n    except SystemExit:\n        pass\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, *argv], env=clean_env(tmp_path), capture_output=True,
                         text=True, timeout=60, cwd=tmp_path, check=False)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_config_convert_writes_a_valid_file_and_prints_notes(tmp_path):
    res = impel(["config", "convert", "--to", "deepspeed", str(FIXTURES / "accelerate_fsdp.yaml"), "-o", "ds.yaml"],
                tmp_path)
    assert res.returncode == 0, res.output
    assert "note: fsdp_transformer_layer_cls_to_wrap: wrapping is transparent" in res.stderr
    written = yaml.safe_load((tmp_path / "ds.yaml").read_text())
    assert written["distributed_type"] == "DEEPSPEED" and written["deepspeed_config"]["zero_stage"] == 3
    assert impel(["config", "validate", "ds.yaml"], tmp_path).returncode == 0
