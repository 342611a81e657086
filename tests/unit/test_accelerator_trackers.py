"""Accelerate's tracking API on the Accelerator: log_with, init_trackers, log, get_tracker, end_training."""
from __future__ import annotations

import json
import os

import pytest

from impel import Accelerator, ConfigError, ProjectConfiguration
from impel.state import ProcessState


@pytest.fixture(autouse=True)
def fresh_state():
    ProcessState._reset()
    yield
    ProcessState._reset()


def test_jsonl_tracker_logs_rows_under_the_project_and_closes_at_end_training(tmp_path):
    acc = Accelerator(cpu=True, log_with="jsonl", project_config=ProjectConfiguration(project_dir=str(tmp_path)))
    acc.init_trackers("run1", config={"lr": 0.1})
    acc.log({"loss": 1.5}, step=3)
    acc.log({"loss": 1.25})  # step defaults to accelerator.step
    tracker = acc.get_tracker("jsonl")
    assert acc.trackers == [tracker] and acc.get_tracker("jsonl", unwrap=True) is tracker
    acc.end_training()
    rows = [json.loads(line) for line in (tmp_path / "run1" / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 3, "loss": 1.5}, {"step": acc.step, "loss": 1.25}]
    assert acc.trackers == []


def test_log_without_trackers_is_a_no_op_and_get_tracker_names_the_active_ones(tmp_path):
    acc = Accelerator(cpu=True)
    acc.init_trackers("x")
    acc.log({"loss": 1.0})
    with pytest.raises(ValueError, match=r"no tracker named 'tensorboard'"):
        acc.get_tracker("tensorboard")


def test_bad_log_with_values_raise_when_the_accelerator_is_built(monkeypatch):
    with pytest.raises(ConfigError, match=r"log_with='nope' is not a tracker impel knows; use one of .*jsonl"):
        Accelerator(cpu=True, log_with="nope")
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a, **k: None)
    with pytest.raises(ConfigError, match=r"log_with='wandb' needs the 'wandb' package.*pip install wandb"):
        Accelerator(cpu=True, log_with=["wandb"])


def test_init_trackers_twice_and_unsupported_kwargs_raise(tmp_path):
    acc = Accelerator(cpu=True, log_with="jsonl", project_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="init_kwargs"):
        acc.init_trackers("r", init_kwargs={"wandb": {"entity": "me"}})
    acc.init_trackers("r")
    with pytest.raises(ConfigError, match="already called"):
        acc.init_trackers("r")
    with pytest.raises(ConfigError, match="log_kwargs"):
        acc.log({"a": 1}, log_kwargs={"wandb": {}})
    acc.end_training()
    assert os.path.isfile(tmp_path / "r" / "metrics.jsonl")
