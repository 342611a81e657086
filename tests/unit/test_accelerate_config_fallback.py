"""Without impel's own config file, impel reads Accelerate's default one (a machine set up with
``accelerate config`` keeps working); impel's file, or $IMPEL_CONFIG_FILE, always comes first."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from impel import ConfigError
from impel.config import environment as env

ACCELERATE_DEFAULT = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "NO", "mixed_precision": "no",
                      "num_processes": 1, "num_machines": 1, "machine_rank": 0, "use_cpu": True,
                      "rdzv_backend": "static", "same_network": False, "debug": False, "downcast_bf16": False,
                      "main_training_function": "main", "enable_cpu_affinity": False, "tpu_use_cluster": False,
                      "tpu_use_sudo": False}  # what `accelerate config default` writes on a CPU machine


def _homes(tmp_path):
    return {"HF_HOME": str(tmp_path / "hf"), "XDG_CACHE_HOME": str(tmp_path / "xdg")}


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def test_accelerate_default_is_read_when_impel_has_none(tmp_path):
    environ = _homes(tmp_path)
    theirs = os.path.join(environ["HF_HOME"], "accelerate", "default_config.yaml")
    assert env.config_to_read(environ=environ) == (env.default_config_path(environ), False)  # neither exists
    _write(theirs, json.dumps(ACCELERATE_DEFAULT))  # Accelerate writes JSON text into the .yaml file
    assert env.config_to_read(environ=environ) == (theirs, True)
    _write(env.default_config_path(environ), "mixed_precision: bf16\n")
    assert env.config_to_read(environ=environ) == (env.default_config_path(environ), False)


def test_accelerate_json_default_and_hf_home_fallback(tmp_path):
    environ = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    theirs = os.path.join(environ["XDG_CACHE_HOME"], "huggingface", "accelerate", "default_config.json")
    _write(theirs, json.dumps(ACCELERATE_DEFAULT))
    assert env.config_to_read(environ=environ) == (theirs, True)


def test_impel_config_file_variable_wins_and_must_name_a_file(tmp_path):
    """$IMPEL_CONFIG_FILE comes before Accelerate's file; naming a missing file or a directory is one clear error
    (it was silently ignored), except for ``impel config``, which writes a missing file there."""
    environ = dict(_homes(tmp_path), IMPEL_CONFIG_FILE=str(tmp_path / "mine.yaml"))
    _write(os.path.join(environ["HF_HOME"], "accelerate", "default_config.yaml"), json.dumps(ACCELERATE_DEFAULT))
    with pytest.raises(ConfigError, match=f"IMPEL_CONFIG_FILE={tmp_path / 'mine.yaml'} does not exist; write it "
                                          "with `impel config`"):
        env.config_to_read(environ=environ)
    assert env.config_path_to_write(environ) == str(tmp_path / "mine.yaml")
    _write(str(tmp_path / "mine.yaml"), "mixed_precision: bf16\n")
    assert env.config_to_read(environ=environ) == (str(tmp_path / "mine.yaml"), False)
    environ["IMPEL_CONFIG_FILE"] = str(tmp_path)
    for call in (lambda: env.config_to_read(environ=environ), lambda: env.config_path_to_write(environ)):
        with pytest.raises(ConfigError, match=f"IMPEL_CONFIG_FILE={tmp_path} is a directory, not a file; point it "
                                              "at the YAML file itself"):
            call()


def test_config_show_names_accelerates_file(tmp_path):
    environ = dict(os.environ, **_homes(tmp_path))
    environ.pop("IMPEL_CONFIG_FILE", None)
    theirs = os.path.join(environ["HF_HOME"], "accelerate", "default_config.yaml")
    _write(theirs, json.dumps(dict(ACCELERATE_DEFAULT, mixed_precision="bf16")))
    out = subprocess.run([sys.executable, "-m", "impel.commands.main", "config", "show"], env=environ,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert f"# {theirs} (Accelerate's default config" in out
    assert "mixed_precision: bf16" in out
