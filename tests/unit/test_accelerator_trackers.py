"""Accelerate's tracking API on the Accelerator (log_with, init_trackers, log, get_tracker, end_training) and the
custom-tracker contract (GeneralTracker, on_main_process, register_tracker_class, LoggerType), in one process.
The real trackers, written and read back against Accelerate's, are in tests/multiprocess/test_trackers.py."""
from __future__ import annotations

import json
import os

import pytest

from impel import Accelerator, ConfigError, ProjectConfiguration
from impel.trackers.registry import (
    LOGGER_TYPE_TO_CLASS,
    GeneralTracker,
    LoggerType,
    on_main_process,
    register_tracker_class,
)


class Recorder(GeneralTracker):
    name = "recorder"
    requires_logging_directory = False

    def __init__(self, main_process_only: bool = True) -> None:
        super().__init__()
        self.main_process_only = main_process_only
        self.calls: list[tuple] = []

    @property
    def tracker(self) -> list[tuple]:
        return self.calls

    def start(self) -> None:
        self.calls.append(("start",))

    def store_init_configuration(self, values: dict) -> None:
        self.calls.append(("config", values))

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        self.calls.append(("log", values, step, kwargs))

    def finish(self) -> None:
        self.calls.append(("finish",))


def test_jsonl_tracker_logs_rows_under_the_project_and_closes_at_end_training(tmp_path):
    acc = Accelerator(cpu=True, log_with="jsonl", project_config=ProjectConfiguration(project_dir=str(tmp_path)))
    acc.init_trackers("run1", config={"lr": 0.1})
    acc.log({"loss": 1.5}, step=3)
    acc.log({"loss": 1.25})  # a JSONL row always carries a step: accelerator.step when none is given
    tracker = acc.get_tracker("jsonl")
    assert acc.trackers == [tracker] and acc.get_tracker("jsonl", unwrap=True) is tracker
    acc.end_training()
    rows = [json.loads(line) for line in (tmp_path / "run1" / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 3, "loss": 1.5}, {"step": acc.step, "loss": 1.25}]
    assert acc.trackers == []


def test_a_custom_tracker_gets_start_config_log_kwargs_and_finish_in_accelerates_order(tmp_path):
    recorder = Recorder()
    acc = Accelerator(cpu=True, log_with=[recorder, "jsonl"], project_dir=str(tmp_path))
    assert acc.log_with == [recorder, "jsonl"]
    acc.init_trackers("p", config={"lr": 0.1}, init_kwargs={"recorder": {"ignored": 1}})  # built already: unused
    acc.log({"loss": 0.5}, step=2, log_kwargs={"recorder": {"commit": False}, "wandb": {"other": 1}})
    acc.log({"loss": 0.25})  # step None reaches the tracker as None (Accelerate's semantics)
    assert acc.get_tracker("recorder") is recorder and acc.get_tracker("recorder", unwrap=True) is recorder.calls
    acc.end_training()
    assert recorder.calls == [("start",), ("config", {"lr": 0.1}), ("log", {"loss": 0.5}, 2, {"commit": False}),
                              ("log", {"loss": 0.25}, None, {}), ("finish",)]


def test_a_registered_tracker_class_is_built_with_project_logging_dir_and_its_init_kwargs(tmp_path):
    built = []

    class Mine(Recorder):
        name = "mine"
        requires_logging_directory = True

        def __init__(self, run_name: str, logging_dir: str, **kwargs) -> None:
            super().__init__()
            built.append((run_name, logging_dir, kwargs))

    register_tracker_class(Mine)
    try:
        acc = Accelerator(cpu=True, log_with="mine", project_config=ProjectConfiguration(
            project_dir=str(tmp_path), logging_dir=str(tmp_path / "logs")))
        acc.init_trackers("proj", init_kwargs={"mine": {"flavour": "x"}})
        acc.log({"a": 1}, log_kwargs={"mine": {"k": 2}})
        mine = acc.get_tracker("mine")
        acc.end_training()
    finally:
        del LOGGER_TYPE_TO_CLASS["mine"]  # the registry is process-wide
    assert built == [("proj", str(tmp_path / "logs"), {"flavour": "x"})]
    assert mine.calls == [("start",), ("log", {"a": 1}, None, {"k": 2}), ("finish",)]  # no config: none stored
    with pytest.raises(ValueError, match="must be a subclass of `GeneralTracker`"):
        register_tracker_class(dict)  # type: ignore[arg-type]


def test_get_tracker_is_a_no_op_stand_in_where_the_tracker_does_not_run_and_raises_for_unknown_names(tmp_path):
    acc = Accelerator(cpu=True)
    acc.init_trackers("x")
    acc.log({"loss": 1.0})  # no trackers: a no-op
    blank = acc.get_tracker("tensorboard")  # Accelerate: a blank GeneralTracker when none runs on this process
    assert type(blank) is GeneralTracker and blank.log({"a": 1}) is None
    acc = Accelerator(cpu=True, log_with="jsonl", project_dir=str(tmp_path))
    acc.init_trackers("x")
    with pytest.raises(ValueError, match=r"tensorboard is not an available tracker.*\['jsonl'\]"):
        acc.get_tracker("tensorboard")
    acc.end_training()


def test_bad_log_with_values_raise_when_the_accelerator_is_built(monkeypatch):
    with pytest.raises(ConfigError, match=r"log_with='nope' is not a tracker impel knows; use one of "
                                          r"tensorboard, wandb, mlflow, trackio, jsonl"):
        Accelerator(cpu=True, log_with="nope")
    with pytest.raises(ConfigError, match=r"log_with='aim' is not a tracker impel knows"):
        Accelerator(cpu=True, log_with=LoggerType.AIM)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a, **k: None)
    with pytest.raises(ConfigError, match=r"log_with='wandb' needs the 'wandb' package.*pip install wandb"):
        Accelerator(cpu=True, log_with=["wandb"])


def test_log_with_all_adds_every_installed_tracker_after_the_named_ones(monkeypatch, tmp_path):
    installed = {"tensorboard", "mlflow"}
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a, **k: object() if name in installed else None)
    recorder = Recorder()
    acc = Accelerator(cpu=True, log_with=[recorder, "mlflow", LoggerType.ALL], project_dir=str(tmp_path))
    assert acc.log_with == [recorder, "mlflow", "tensorboard"]


def test_init_trackers_twice_raises(tmp_path):
    acc = Accelerator(cpu=True, log_with="jsonl", project_dir=str(tmp_path))
    acc.init_trackers("r")
    with pytest.raises(ConfigError, match="already called"):
        acc.init_trackers("r")
    acc.end_training()
    assert os.path.isfile(tmp_path / "r" / "metrics.jsonl")


def test_general_tracker_names_missing_attributes_as_accelerate_does():
    class Incomplete(GeneralTracker):
        pass

    with pytest.raises(NotImplementedError) as ours:
        Incomplete()
    assert ours.value.args[0].endswith("`name`, `requires_logging_directory`, `tracker`")
    tracking = pytest.importorskip("accelerate.tracking")

    class TheirIncomplete(tracking.GeneralTracker):
        pass

    with pytest.raises(NotImplementedError) as theirs:
        TheirIncomplete()
    assert ours.value.args == theirs.value.args
    assert type(GeneralTracker(_blank=True)).main_process_only is True


def test_on_main_process_follows_main_process_only(monkeypatch):
    class Tracked:
        main_process_only = True

        @on_main_process
        def log(self) -> str:
            return "ran"

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    everywhere = Tracked()
    everywhere.main_process_only = False
    assert Tracked().log() is None and everywhere.log() == "ran"
    monkeypatch.setenv("RANK", "0")
    assert Tracked().log() == "ran"


def test_logger_type_and_tracking_names_match_accelerate():
    tracking = pytest.importorskip("accelerate.tracking")
    from accelerate.utils import LoggerType as TheirLoggerType

    assert LoggerType.list() == TheirLoggerType.list() and "wandb" in LoggerType and "nope" not in LoggerType
    import impel.trackers.registry

    built = ["GeneralTracker", "on_main_process", "register_tracker_class", "get_available_trackers",
             "LOGGER_TYPE_TO_CLASS", "TensorBoardTracker", "WandBTracker", "MLflowTracker", "TrackioTracker"]
    assert all(hasattr(tracking, n) and hasattr(impel.trackers.registry, n) for n in built)
    for name in ("tensorboard", "wandb", "mlflow", "trackio"):
        ours, theirs = LOGGER_TYPE_TO_CLASS[name], tracking.LOGGER_TYPE_TO_CLASS[name]
        assert (ours.name, ours.requires_logging_directory) == (theirs.name, theirs.requires_logging_directory)


def test_mlflow_skinny_without_a_tracking_uri_names_the_fix(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from impel.trackers.registry import MLflowTracker

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")  # MLflow 3's default store
    real_find_spec = __import__("importlib.util").util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "sqlalchemy" else
                        real_find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"mlflow-skinny cannot write: pip install mlflow, or set MLFLOW_TRACKING"):
        MLflowTracker("proj").start()
