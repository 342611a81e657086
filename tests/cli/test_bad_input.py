"""Every bad input to ``impel launch`` gives one paragraph naming the problem and the fix, exit code 2, no Python
traceback, and no process started (the script would leave a marker file)."""
from __future__ import annotations

import pytest

from bad_inputs import BAD_DEEPSPEED_JSON, BAD_FILES, BAD_FLAGS, DS_YAML
from cli_helpers import SCRIPTS, impel
from impel.commands import launch
from impel.commands.main import main

REPORT = str(SCRIPTS / "report.py")

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
    monkeypatch.delenv("IMPEL_CONFIG_FILE", raising=False)  # no user config: empty cache homes
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "cache" / "huggingface"))
    marker = tmp_path / "started"
    code = main(["launch", "--use_deepspeed", REPORT, "--touch", str(marker)])
    err = capsys.readouterr().err
    assert code == 2 and "needs DeepSpeed, which is not installed" in err and "pip install 'impel[deepspeed]'" in err
    assert not marker.exists()


def test_unknown_flag_is_an_argparse_error(tmp_path):
    res = impel(["launch", "--mixed_precison", "bf16", REPORT], tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.output
    assert "unrecognized arguments: --mixed_precison" in res.stderr or "--mixed_precison" in res.stderr


def test_deepspeed_json_contradicting_a_flag_fails_before_launch(tmp_path):
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 3}}')
    marker = tmp_path / "started"
    res = impel(["launch", "--use_deepspeed", "--zero_stage", "2", "--deepspeed_config_file", "ds.json", REPORT,
                 "--touch", str(marker)], tmp_path)
    _assert_clean_failure(res, ["zero_stage=2 contradicts zero_optimization.stage=3 in the DeepSpeed JSON"], marker)


@pytest.mark.parametrize("command", [["config", "validate"], ["config", "convert", "--to", "fsdp"]])
@pytest.mark.parametrize("name", sorted(BAD_DEEPSPEED_JSON))
def test_a_bad_deepspeed_json_fails_validate_and_convert(name, command, tmp_path, monkeypatch, capsys):
    text, fragments = BAD_DEEPSPEED_JSON[name]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds.yaml").write_text(DS_YAML)
    if text is not None:
        (tmp_path / "ds.json").write_text(text)
    code = main([*command, "ds.yaml"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (out, err)
    assert err.startswith("impel config: error:") and err.count("\n") == 1, err
    for fragment in fragments:
        assert fragment in err, err


def test_a_consistent_deepspeed_json_validates(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds.yaml").write_text(DS_YAML)
    (tmp_path / "ds.json").write_text('{"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, '
                                      '"gradient_accumulation_steps": "auto", "bf16": {"enabled": "auto"}}')
    assert main(["config", "validate", "ds.yaml"]) == 0, capsys.readouterr().err
