"""Issue 36: the documented command lines parse as written; the launcher's own checks of what it is given to run."""
from __future__ import annotations

import pytest

from impel.commands import launch
from impel.commands.main import build_parser, parse
from impel.config.elastic import smallest_steps
from impel.config.run_config import ConfigError

# each launcher flag that takes a value, then a bare bool flag right before the script (ate the script name)
VALUED = [["--nnodes", "1:2"], ["--node_rank", "0"], ["--stall_warning", "5"], ["--tee", "3"],
          ["--log_dir", "logs"], ["--rdzv_conf", "last_call_timeout=10"]]


def _parse(argv):
    return parse(build_parser(), argv)


@pytest.mark.parametrize("flag", VALUED, ids=[f[0] for f in VALUED])
def test_a_bare_bool_flag_after_a_launcher_flag_leaves_the_script(flag):
    ns = _parse(["launch", *flag, "--auto_resume", "train.py", "--lr", "1"])
    assert (ns.script, ns.script_args) == ("train.py", ["--lr", "1"])
    assert getattr(ns, flag[0][2:]) == flag[1]


def test_the_elastic_command_line_of_the_docs_parses():
    ns = _parse(["launch", "--nnodes", "1:2", "--machine_rank", "0", "--main_process_ip", "127.0.0.1",
                 "--main_process_port", "29611", "--max_restarts", "3", "--auto_resume", "train.py"])
    assert ns.script == "train.py" and ns.nnodes == "1:2"
    ns = _parse(["launch", "--tee", "3", "--log_dir", "logs", "--cpu", "quick.py"])
    assert (ns.script, ns.tee, ns.log_dir) == ("quick.py", "3", "logs")


def test_a_wide_elastic_range_has_no_accumulation():
    assert smallest_steps(1, 4) == 3
    assert smallest_steps(32, 64) is None  # was 18472920064106597929865025


def _script(tmp_path, monkeypatch, *argv):
    monkeypatch.chdir(tmp_path)
    return launch._script_command(_parse(["launch", *argv]))


def test_what_python_runs_the_launcher_runs(tmp_path, monkeypatch):
    """A directory with ``__main__.py`` and ``-m`` of a package in the working directory (as ``python`` runs them)."""
    for name in ("goodmod", "plain"):
        (tmp_path / name).mkdir()
    (tmp_path / "goodmod" / "__init__.py").write_text("")
    (tmp_path / "goodmod" / "__main__.py").write_text("print(1)\n")
    assert _script(tmp_path, monkeypatch, "-m", "goodmod") == ["-m", "goodmod"]
    assert _script(tmp_path, monkeypatch, "goodmod", "x") == ["goodmod", "x"]
    with pytest.raises(ConfigError, match="'plain' is a directory, not a script"):
        _script(tmp_path, monkeypatch, "plain")
    (tmp_path / "run.sh").write_text("#!/bin/sh\n")
    (tmp_path / "run.sh").chmod(0o755)
    assert _script(tmp_path, monkeypatch, "--no_python", "./run.sh") == ["./run.sh"]
    assert _script(tmp_path, monkeypatch, "--no_python", "true") == ["true"]
